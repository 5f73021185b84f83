// One incarnation of a connection server, as the registry sees it: its heartbeat, the
// registrations of its users (or connections), and what happens once it is fenced.

import * as cluster from './cluster.js';
import { connOf, type Conn } from './conn.js';
import { ClosedError, FencedError, isFencedReply, isTransient, RedisTimeoutError } from './errors.js';
import { checkConnectionId, checkServerId, checkUserId, newServerId, type UserId } from './ids.js';
import { checkLayout, entryOf, Keys, type Arg, type Layout } from './keys.js';
import {
  retryPolicy, withDeadline, withRetry, type Attempt, type RetryOptions, type RetryPolicy,
} from './retry.js';
import { evalsha } from './scripts.js';

export interface HeartbeatLost {
  /** Unix ms of the last heartbeat that succeeded (or of start()); the liveness key
   * expired at about sinceMs + ttlMs. */
  sinceMs: number;
  /** How long heartbeats have failed, in ms (more than ttlMs). */
  forMs: number;
  /** The last heartbeat's error. */
  error: unknown;
}

export interface HeartbeatRestored {
  /** Unix ms of the last heartbeat that succeeded before the lost stretch. */
  sinceMs: number;
  /** How long the stretch lasted, in ms. */
  forMs: number;
}

export interface ConnectionServerOptions {
  /** This incarnation's id: ConnectionServer.newServerId('gw-7') -> 'gw-7#<unix ms>'. */
  serverId: string;
  /** 'hash' | 'keys' | 'conns' (default 'keys'); the janitor's `layout` setting. */
  layout?: Layout;
  /** The janitor's `key_prefix` setting (default empty). */
  keyPrefix?: string;
  /** TTL of the liveness key (default 3000 ms). */
  ttlMs?: number;
  /** Time between heartbeats (default ttlMs / 3). */
  heartbeatIntervalMs?: number;
  /** Called once, the first time any call learns that this server id is fenced. */
  onFenced?: (err: FencedError) => void;
  /** Called once per stretch in which heartbeats could not reach Redis for longer than
   * ttlMs; heartbeats keep trying. */
  onHeartbeatLost?: (info: HeartbeatLost) => void;
  /** Called when a heartbeat succeeds again after such a stretch. */
  onHeartbeatRestored?: (info: HeartbeatRestored) => void;
  /** Retries of start(), register(), unregister() and close() on states that pass. */
  retry?: RetryOptions;
}

type State = 'new' | 'starting' | 'running' | 'closing' | 'closed';

/** The calls of one entry (a user; layout conns: a user's connection), in the order they
 * were made. */
interface Slot {
  /** Bumped by every call: the call holding the current value is the newest. */
  gen: number;
  /** Calls of this entry that have not settled. */
  calls: number;
  /** Settles when the attempt in flight (its every command) has ended; undefined when none. */
  attempt: Promise<void> | undefined;
}

/** A call superseded by a later call of the same entry (or a register by close()): it
 * sends nothing more. */
class Superseded {
  constructor(readonly byClose: boolean) {}
}
const SUPERSEDED = new Superseded(false);
const SUPERSEDED_BY_CLOSE = new Superseded(true);

const noop = () => undefined;

/** A call's place in the order of its entry. */
interface Turn {
  /** Whether the call is still the newest of its entry. */
  current(): boolean;
  /** withRetry, in the order of the entry: each attempt waits for the attempt in flight
   * and, unless `always`, is not sent once the call is superseded (a register: or close()
   * has begun) or the server fenced. */
  retry<R>(attempt: (timeoutMs: number, attempt: Attempt) => Promise<R>, always?: boolean): Promise<R>;
}

/** Registrations unregistered at once by close(). */
const CLOSE_BATCH = 200;

/** Calls an application callback; an exception it throws (or a promise it rejects) is
 * thrown again outside of this package's code, as an EventEmitter listener's would be. */
function invoke<A>(callback: ((arg: A) => unknown) | undefined, arg: A): void {
  if (typeof callback !== 'function') return;
  try {
    const result = callback(arg) as { then?: unknown } | undefined;
    if (result && typeof result.then === 'function') {
      (result as Promise<unknown>).then(undefined, (err) => queueMicrotask(() => { throw err; }));
    }
  } catch (err) {
    queueMicrotask(() => { throw err; });
  }
}

export class ConnectionServer {
  /** `base` + '#' + unix ms: a new server id (a new incarnation of the same machine). */
  static newServerId = newServerId;

  readonly serverId: string;
  readonly layout: Layout;
  readonly keyPrefix: string;
  readonly ttlMs: number;
  readonly heartbeatIntervalMs: number;

  private readonly conn: Conn;
  private readonly keys: Keys;
  private readonly retry: RetryPolicy;
  private readonly options: ConnectionServerOptions;
  private state: State = 'new';
  private fencedBy: FencedError | undefined;
  private timer: NodeJS.Timeout | undefined;
  /** Whether the heartbeat timer runs: from start() to the fence or the end of close(). */
  private beating = false;
  /** Settles when the last heartbeat (its every command) has ended. */
  private heartbeat: Promise<void> | undefined;
  private heartbeatFailures = 0;
  private lastHeartbeatMs = 0;
  private lost = false;
  /** The last success before the current lost stretch. */
  private lostSinceMs = 0;
  private closing: Promise<void> | undefined;
  /** What this object registered and did not unregister, for close(). */
  private readonly registered = new Map<string, { user: Arg; connection?: string }>();
  private readonly inFlight = new Set<Promise<unknown>>();
  /** Per entry (trackKey), the order of its calls. */
  private readonly slots = new Map<string, Slot>();

  constructor(redis: unknown, options: ConnectionServerOptions) {
    if (options === null || typeof options !== 'object') throw new TypeError('options { serverId, ... } are required');
    this.conn = connOf(redis);
    this.serverId = checkServerId(options.serverId);
    this.layout = checkLayout(options.layout ?? 'keys');
    this.keyPrefix = options.keyPrefix ?? '';
    this.keys = new Keys(this.keyPrefix);
    this.ttlMs = options.ttlMs ?? 3000;
    this.heartbeatIntervalMs = options.heartbeatIntervalMs ?? Math.max(1, Math.floor(this.ttlMs / 3));
    if (!Number.isInteger(this.ttlMs) || this.ttlMs < 1) throw new TypeError('ttlMs must be a whole number of ms, at least 1');
    if (!(this.heartbeatIntervalMs > 0 && this.heartbeatIntervalMs < this.ttlMs)) {
      throw new TypeError('heartbeatIntervalMs must be above 0 and below ttlMs');
    }
    this.retry = retryPolicy(options.retry);
    this.options = options;
  }

  /** Whether a call learned that this server id is fenced (declared dead). */
  get fenced(): boolean {
    return this.fencedBy !== undefined;
  }

  /** The first heartbeat (it rejects with FencedError if this id is fenced), then one
   * every heartbeatIntervalMs until FENCED or close(). */
  async start(): Promise<void> {
    if (this.state !== 'new') {
      throw this.state === 'closing' || this.state === 'closed'
        ? new ClosedError(this.serverId)
        : new Error(`ConnectionServer ${this.serverId}: start() was called already`);
    }
    if (this.fencedBy) throw this.fencedError();
    this.state = 'starting';
    try {
      await withRetry(this.retry, (t) => {
        if (this.state !== 'starting') throw new ClosedError(this.serverId);
        return this.heartbeatOnce(t);
      });
    } catch (err) {
      if (this.state === 'starting') this.state = 'new';
      throw err;
    }
    if (this.state !== 'starting') return; // closed meanwhile
    this.state = 'running';
    this.beating = true;
    this.schedule(this.heartbeatIntervalMs);
  }

  /** Registers `user` on this server; layout conns: its connection `connection`. Rejects
   * with FencedError (nothing written) once this id is fenced. Calls of one entry apply in
   * the order they were made: a later unregister (or register) of the same entry
   * supersedes this one while it waits to retry (it then resolves, sending nothing more);
   * close() does too (it then rejects with ClosedError; close() unregisters the entry). */
  register(user: UserId, connection?: string): Promise<void> {
    return this.track(async () => {
      const [u, c] = this.checkEntry(user, connection);
      if (this.state === 'closing' || this.state === 'closed') throw new ClosedError(this.serverId);
      if (this.fencedBy) throw this.fencedError();
      if (this.state !== 'running') {
        throw new Error(`ConnectionServer ${this.serverId}: register() before start() has completed`);
      }
      await this.registerChecked(u, c);
    });
  }

  /** A clean disconnect: the entry (layout conns: the connection's field) goes if it still
   * names this server, then the member. Resolves true if an entry was deleted. Rejects
   * with FencedError once this id is fenced; after close(), resolves false (close() has
   * unregistered everything). It waits for an attempt in flight of an earlier register of
   * the same entry, and supersedes that register (no further attempt of it is sent); a
   * later call of the entry supersedes it likewise (it then resolves false). */
  unregister(user: UserId, connection?: string): Promise<boolean> {
    return this.track(async () => {
      const [u, c] = this.checkEntry(user, connection);
      if (this.fencedBy) throw this.fencedError();
      if (this.state === 'closing' || this.state === 'closed') return false;
      return this.unregisterChecked(u, c);
    });
  }

  /** Graceful shutdown: waits for the calls in flight, unregisters everything this object
   * registered and did not unregister (heartbeating meanwhile), stops the heartbeat, then
   * removes the liveness key and the `servers` member, so that nothing is left for the
   * janitor and no server.dead comes. If some entry cannot be unregistered, the heartbeat
   * stops and the liveness is left to expire (the janitor then cleans up after this
   * server) and close() rejects with an AggregateError. A fenced server touches nothing. */
  close(): Promise<void> {
    this.closing ??= this.shutdown();
    return this.closing;
  }

  private async shutdown(): Promise<void> {
    const wasStarted = this.state === 'running' || this.state === 'starting';
    this.state = 'closing';
    try {
      // The heartbeat goes on until the entries are unregistered: a close() slowed by
      // retries past the TTL is not declared dead halfway.
      await Promise.allSettled([...this.inFlight]);
      if (this.fencedBy || !wasStarted) return;
      const entries = [...this.registered.values()];
      const failures: unknown[] = [];
      let left = 0;
      for (let i = 0; i < entries.length && !this.fencedBy; i += CLOSE_BATCH) {
        const batch = entries.slice(i, i + CLOSE_BATCH);
        if (failures.some(isTransient)) {
          left += batch.length; // Redis is away: the janitor will do the rest
          continue;
        }
        const results = await Promise.allSettled(batch.map((e) => this.unregisterChecked(e.user, e.connection)));
        for (const r of results) if (r.status === 'rejected') failures.push(r.reason);
      }
      if (this.fencedBy) return;
      if (failures.length > 0) {
        throw new AggregateError(
          failures,
          `ConnectionServer ${this.serverId}: close() could not unregister ${failures.length + left} of ` +
            `${entries.length} entries; its liveness is left to expire, so that the janitor cleans up after it`,
        );
      }
      // No heartbeat may land after the liveness key is deleted.
      this.stopHeartbeat();
      await withDeadline(this.heartbeat ?? Promise.resolve(), this.retry.timeoutMs).catch(noop);
      const alive = this.keys.alive(this.serverId);
      const servers = this.keys.servers();
      await withRetry(this.retry, (t) =>
        Promise.all([
          this.conn.send(alive, ['DEL', alive], t),
          this.conn.send(servers, ['ZREM', servers, this.serverId], t),
        ]),
      );
    } finally {
      this.stopHeartbeat();
      this.state = 'closed';
    }
  }

  // --- registrations -------------------------------------------------------------------

  private checkEntry(user: UserId, connection: string | undefined): [Arg, string | undefined] {
    const u = checkUserId(user);
    if (this.layout === 'conns') return [u, checkConnectionId(connection)];
    if (connection !== undefined) {
      throw new TypeError(`a connection id is for layout conns; this server is layout ${this.layout}`);
    }
    return [u, undefined];
  }

  /** The key of an entry in `registered`: the user's bytes (layout conns: the member
   * `<connection> <user>`), so that a string and a Buffer of the same bytes are one. */
  private trackKey(user: Arg, connection: string | undefined): string {
    const bytes = (typeof user === 'string' ? Buffer.from(user) : user).toString('latin1');
    return connection === undefined ? bytes : `${connection} ${bytes}`;
  }

  private scriptArgs(user: Arg, connection: string | undefined): Arg[] {
    return this.layout === 'conns'
      ? [user, this.serverId, connection as string]
      : [user, this.serverId, this.layout];
  }

  private ownKeys(): string[] {
    const s = this.serverId;
    return [this.keys.fenced(s), this.keys.refused(s), this.keys.users(s)];
  }

  // --- the order of the calls of one entry ---------------------------------------------

  /** Runs `body`, a call on the entry `key`, as the newest call of that entry: an earlier
   * call still pending is superseded (it sends nothing more and resolves with its
   * `superseded` value). `body` sends through turn.retry, whose every attempt first waits
   * for the attempt of this entry in flight (an earlier call's, or one given up on), then
   * sends only if its call is still the newest. */
  private inTurn<T>(
    key: string,
    kind: 'register' | 'unregister',
    superseded: T,
    body: (turn: Turn) => Promise<T>,
  ): Promise<T> {
    let slot = this.slots.get(key);
    if (slot === undefined) {
      slot = { gen: 0, calls: 0, attempt: undefined };
      this.slots.set(key, slot);
    }
    const s = slot;
    const gen = ++s.gen;
    s.calls += 1;
    const superseding = () => {
      if (s.gen !== gen) return SUPERSEDED;
      // close() is the last call of every entry: it unregisters what is left.
      if (kind === 'register' && (this.state === 'closing' || this.state === 'closed')) return SUPERSEDED_BY_CLOSE;
      return undefined;
    };
    const turn: Turn = {
      current: () => s.gen === gen,
      retry: (attempt, always = false) =>
        withRetry(this.retry, async (t, a) => {
          // An attempt of this entry in flight: its commands may still land. Wait for it
          // (within this attempt's time), then send only if still the newest call.
          while (s.attempt !== undefined) {
            if (!always && superseding()) throw superseding();
            await s.attempt;
            if (a.abandoned) throw new RedisTimeoutError(t);
          }
          if (!always) {
            const by = superseding();
            if (by) throw by;
            if (this.fencedBy) throw this.fencedError();
          }
          const sent = attempt(t, a);
          const ended: Promise<void> = sent.then(noop, noop).then(() => {
            if (s.attempt === ended) s.attempt = undefined;
            this.dropSlot(key, s);
          });
          s.attempt = ended;
          return sent;
        }),
    };
    const run = async () => {
      try {
        return await body(turn);
      } catch (err) {
        if (err === SUPERSEDED) return superseded;
        if (err === SUPERSEDED_BY_CLOSE) throw new ClosedError(this.serverId);
        throw err;
      } finally {
        s.calls -= 1;
        this.dropSlot(key, s);
      }
    };
    return run();
  }

  private dropSlot(key: string, slot: Slot): void {
    if (slot.calls === 0 && slot.attempt === undefined && this.slots.get(key) === slot) this.slots.delete(key);
  }

  private registerChecked(user: Arg, connection: string | undefined): Promise<void> {
    const key = this.trackKey(user, connection);
    const entry = entryOf(this.keys, this.layout, user, connection, this.serverId);
    const script = this.layout === 'conns' ? 'register_conn' : 'register';
    const args = this.scriptArgs(user, connection);
    return this.inTurn(key, 'register', undefined, async (turn) => {
      this.registered.set(key, { user, connection });
      try {
        if (this.conn.topology !== 'cluster') {
          await turn.retry((t, a) => evalsha(this.conn, script, [...this.ownKeys(), entry.key], args, t, false, a));
          return;
        }
        let forwardWritten = false;
        const outcome = await turn.retry((t, a) =>
          cluster.registerSteps(this.conn, this.keys, this.serverId, script, entry, args, t, () => {
            forwardWritten = true;
          }, a),
        );
        if (outcome.fenced === undefined) return;
        const fenced = this.learnFenced(outcome.fenced);
        if (forwardWritten) {
          // Take the forward entry back (whatever came after this call: they are refused).
          // If that fails too, it names a fenced owner, which route never returns and the
          // janitor's drift sweep deletes (and announces).
          await turn.retry((t, a) => cluster.release(this.conn, entry, t, a), true).catch(noop);
        }
        throw fenced;
      } catch (err) {
        // A registration that may have been written (by an attempt before a transient
        // error, or before close() superseded it) stays known to close(); what a later
        // call of the entry did to `registered` stands.
        if (!isTransient(err) && !(err instanceof Superseded) && turn.current()) this.registered.delete(key);
        if (isFencedReply(err)) throw this.learnFenced(err);
        throw err;
      }
    });
  }

  private unregisterChecked(user: Arg, connection: string | undefined): Promise<boolean> {
    const key = this.trackKey(user, connection);
    const entry = entryOf(this.keys, this.layout, user, connection, this.serverId);
    const script = this.layout === 'conns' ? 'unregister_conn' : 'unregister';
    const args = this.scriptArgs(user, connection);
    return this.inTurn(key, 'unregister', false, async (turn) => {
      let deleted = 0;
      try {
        if (this.conn.topology !== 'cluster') {
          deleted = Number(
            await turn.retry((t, a) => evalsha(this.conn, script, [...this.ownKeys(), entry.key], args, t, false, a)),
          );
        } else {
          await turn.retry((t, a) =>
            cluster.unregisterSteps(this.conn, this.keys, this.serverId, script, entry, args, t, (d) => {
              deleted ||= d;
            }, a),
          );
        }
      } catch (err) {
        if (isFencedReply(err) || err instanceof FencedError) {
          if (turn.current()) this.registered.delete(key);
          throw this.learnFenced(err);
        }
        throw err;
      }
      if (turn.current()) this.registered.delete(key);
      return deleted > 0;
    });
  }

  // --- heartbeat -----------------------------------------------------------------------

  /** One heartbeat, within `timeoutMs`; FencedError once fenced. */
  private heartbeatOnce(timeoutMs: number): Promise<void> {
    const run = async () => {
      const now = Date.now();
      try {
        if (this.conn.topology === 'cluster') {
          await cluster.heartbeatSteps(this.conn, this.keys, this.serverId, this.ttlMs, now, timeoutMs);
        } else {
          const s = this.serverId;
          const keys = [this.keys.fenced(s), this.keys.refused(s), this.keys.alive(s), this.keys.servers()];
          await evalsha(this.conn, 'heartbeat', keys, [s, String(this.ttlMs), String(now)], timeoutMs);
        }
      } catch (err) {
        throw isFencedReply(err) ? this.learnFenced(err) : err;
      }
      this.lastHeartbeatMs = now;
    };
    const sent = run();
    this.heartbeat = sent.then(noop, noop);
    return withDeadline(sent, timeoutMs);
  }

  private schedule(delayMs: number): void {
    if (!this.beating || this.fencedBy) return;
    this.timer = setTimeout(() => void this.tick(), Math.max(0, delayMs));
    this.timer.unref();
  }

  private stopHeartbeat(): void {
    this.beating = false;
    clearTimeout(this.timer);
    this.timer = undefined;
  }

  /** A heartbeat of the timer. On failure the next one comes sooner (100 ms, doubling, up
   * to the interval); once heartbeats have failed for longer than ttlMs, onHeartbeatLost. */
  private async tick(): Promise<void> {
    const began = Date.now();
    try {
      await this.heartbeatOnce(this.heartbeatIntervalMs);
    } catch (err) {
      if (err instanceof FencedError || !this.beating) return;
      this.heartbeatFailures += 1;
      const forMs = Date.now() - this.lastHeartbeatMs;
      if (!this.lost && forMs > this.ttlMs) {
        this.lost = true;
        this.lostSinceMs = this.lastHeartbeatMs;
        invoke(this.options.onHeartbeatLost, { sinceMs: this.lastHeartbeatMs, forMs, error: err });
      }
      const backoff = Math.min(this.heartbeatIntervalMs, 100 * 2 ** (this.heartbeatFailures - 1));
      this.schedule(backoff - (Date.now() - began));
      return;
    }
    if (this.lost) {
      this.lost = false;
      invoke(this.options.onHeartbeatRestored, { sinceMs: this.lostSinceMs, forMs: began - this.lostSinceMs });
    }
    this.heartbeatFailures = 0;
    this.schedule(this.heartbeatIntervalMs - (Date.now() - began));
  }

  // --- the fence -----------------------------------------------------------------------

  /** Marks this server fenced (the first time: stops the heartbeat and calls onFenced) and
   * returns the FencedError to reject the call with. */
  private learnFenced(reply: unknown): FencedError {
    if (reply instanceof FencedError) return reply;
    if (this.fencedBy) return this.fencedError();
    const message = reply instanceof Error ? reply.message : undefined;
    this.fencedBy = new FencedError(this.serverId, message);
    this.stopHeartbeat();
    invoke(this.options.onFenced, this.fencedBy);
    return this.fencedBy;
  }

  /** A FencedError for a call made after the fence was learned. */
  private fencedError(): FencedError {
    return new FencedError(this.serverId, this.fencedBy?.message);
  }

  /** Runs `fn`, known to close() until it settles. */
  private track<T>(fn: () => Promise<T>): Promise<T> {
    const p = fn();
    this.inFlight.add(p);
    const done = () => this.inFlight.delete(p);
    p.then(done, done);
    return p;
  }
}
