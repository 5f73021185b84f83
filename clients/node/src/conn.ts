// One way to send a command, whatever the application gave: a node-redis client (or
// client pool), a Sentinel client (createSentinel) or a cluster client (createCluster).

import type { Arg } from './keys.js';

export type Topology = 'node' | 'sentinel' | 'cluster';

export interface Conn {
  readonly topology: Topology;
  /** Sends one command. `key` is the first key (it picks a cluster's node; ignored
   * elsewhere). `timeoutMs`: how long it may wait in the client's queue (offline, or
   * behind a reconnect) before it is dropped with a TimeoutError. */
  send(key: Arg | undefined, args: Arg[], timeoutMs?: number): Promise<unknown>;
}

type SendNode = (args: Arg[], options?: object) => Promise<unknown>;
type SendSentinel = (isReadonly: boolean, args: Arg[], options?: object) => Promise<unknown>;
type SendCluster = (
  key: Arg | undefined,
  isReadonly: boolean,
  args: Arg[],
  options?: object,
) => Promise<unknown>;

function classChain(value: object): string[] {
  const names: string[] = [];
  for (let p = Object.getPrototypeOf(value); p && p !== Object.prototype; p = Object.getPrototypeOf(p)) {
    if (p.constructor?.name) names.push(p.constructor.name);
  }
  return names;
}

/** Which kind of node-redis client `redis` is: by class name first (RedisCluster,
 * RedisSentinel), then by shape (a cluster has `masters` and `slots`, a Sentinel client
 * `getMasterNode`), so that a client from another copy of the `redis` package works too. */
export function topologyOf(redis: unknown): Topology {
  if (redis === null || typeof redis !== 'object' || typeof (redis as any).sendCommand !== 'function') {
    throw new TypeError(
      'expected a node-redis client (createClient, createSentinel or createCluster of the `redis` package)',
    );
  }
  const chain = classChain(redis);
  if (chain.includes('RedisCluster')) return 'cluster';
  if (chain.includes('RedisSentinel')) return 'sentinel';
  if (chain.includes('RedisClient') || chain.includes('RedisClientPool')) return 'node';
  if ('masters' in redis && 'slots' in redis) return 'cluster';
  if (typeof (redis as any).getMasterNode === 'function') return 'sentinel';
  return 'node';
}

/** Our replies are decoded by us: strings and arrays, whatever type mapping the
 * application set on its client. */
const OPTIONS = { typeMapping: {} };

export function connOf(redis: unknown): Conn {
  const topology = topologyOf(redis);
  const r = redis as { sendCommand: (...a: any[]) => Promise<unknown>; isReady?: boolean };
  // A ready client writes a command at once, and rejects it if the socket closes before
  // the reply; one that is not (offline, reconnecting, a failover) queues it: then a
  // timeout drops it from the queue, so that a call given up on does not land much later.
  // (Only then: node-redis's timeout costs an AbortSignal per command.)
  const options = (timeoutMs?: number) =>
    r.isReady === false && timeoutMs !== undefined && timeoutMs > 0
      ? { ...OPTIONS, timeout: Math.ceil(timeoutMs) }
      : OPTIONS;
  switch (topology) {
    case 'cluster':
      return {
        topology,
        // isReadonly false: every command goes to the master of its slot, so that a read
        // never misses a fence a replica has not received yet.
        send: (key, args, t) => (r.sendCommand as SendCluster).call(r, key, false, args, options(t)),
      };
    case 'sentinel':
      return {
        topology,
        // The primary, for the same reason.
        send: (_key, args, t) => (r.sendCommand as SendSentinel).call(r, false, args, options(t)),
      };
    case 'node':
      return {
        topology,
        send: (_key, args, t) => (r.sendCommand as SendNode).call(r, args, options(t)),
      };
  }
}

/** A string reply (a server id) as a string; nil (RESP2) or false (RESP3, a Lua false) as
 * null. */
export function text(reply: unknown): string | null {
  if (reply === null || reply === undefined || reply === false) return null;
  if (typeof reply === 'string') return reply;
  if (reply instanceof Uint8Array) return Buffer.from(reply).toString();
  throw new TypeError(`unexpected reply from Redis: ${String(reply)}`);
}
