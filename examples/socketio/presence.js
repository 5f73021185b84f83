#!/usr/bin/env node
// The presence consumer: who is online, per room, from two streams read as consumer group
// `presence`:
//
// - `presence:notices`, the servers' own notices: `join` (a connection registered) and
//   `leave` (a connection unregistered), each with user, connection (layout conns),
//   server id and room;
// - `registry:evictions`, written by registry-janitor (docs/specification.md, "The
//   evictions stream"; schemas/*.schema.json): `users.evicted` (layouts hash and keys),
//   `connections.evicted` (layout conns: [user, connection] pairs) and `server.cleaned`,
//   MessagePack maps with named keys, user ids as binary strings.
//
// The state is, per user, the server of each connection. Every change names the server
// it is about and applies only if the state still names that server: a leave or an
// eviction for server S removes a connection only if it is on S, so a connection that
// moved elsewhere (its join may come before or after the eviction of its old server, the
// two streams are not ordered with each other) is never dropped. `server.cleaned` for S:
// nothing of S is left in the registry, so every connection still on S is dropped, and a
// join naming S that comes later (a registration written before the fence whose notice
// went out late, e.g. from a frozen server) is ignored: server ids name one incarnation.
// A user is online while they have a connection.
//
// Command line: node presence.js [--redis-url URL] [--key-prefix P] [--once]: with
//   --once, reads what is there (from the group's position), prints the rooms as JSON and
//   exits; otherwise runs on, printing its counts. The layout needs no setting: the entry
//   types tell it. Under a parent (IPC): `start` {...}, `view` {until:
//   {notices, evictions}} answers `view` once it has handled every entry up to those ids.
import os from 'node:os';
import { parseArgs } from 'node:util';
import { createClient, RESP_TYPES } from 'redis';
import { decode } from '@msgpack/msgpack';
import { keys, report } from './lib/util.js';

const GROUP = 'presence';
const BUFFERS = { typeMapping: { [RESP_TYPES.BLOB_STRING]: Buffer } };

function cmpId(a, b) {
  const [am, as] = a.split('-').map(BigInt);
  const [bm, bs] = b.split('-').map(BigInt);
  if (am !== bm) return am < bm ? -1 : 1;
  return as === bs ? 0 : as < bs ? -1 : 1;
}

const text = (v) => (v == null ? '' : Buffer.isBuffer(v) || v instanceof Uint8Array ? Buffer.from(v).toString('utf8') : String(v));

export class Presence {
  constructor() {
    this.users = new Map(); // user -> {room, conns: Map<connection, server>}
    this.cleaned = new Set();
    this.droppedOnCleaned = []; // [user, connection, server]: for the record
    this.stats = {
      entries: 0,
      joins: 0,
      leaves: 0,
      leavesOfMoved: 0,
      evicted: 0,
      evictionsOfMoved: 0,
      cleaned: 0,
      droppedOnCleaned: 0,
      joinsOfCleaned: 0,
      ignored: 0,
    };
  }

  entry(user) {
    let e = this.users.get(user);
    if (!e) {
      e = { room: '', conns: new Map() };
      this.users.set(user, e);
    }
    return e;
  }

  drop(user, conn, server) {
    const e = this.users.get(user);
    if (!e || e.conns.get(conn) !== server) return false;
    e.conns.delete(conn);
    if (e.conns.size === 0) this.users.delete(user);
    return true;
  }

  join({ user, conn, server, room }) {
    if (this.cleaned.has(server)) {
      this.stats.joinsOfCleaned++;
      return;
    }
    const e = this.entry(user);
    if (room) e.room = room;
    e.conns.set(conn, server);
    this.stats.joins++;
  }

  leave({ user, conn, server }) {
    if (this.drop(user, conn, server)) this.stats.leaves++;
    else this.stats.leavesOfMoved++;
  }

  evicted(server, pairs) {
    for (const [user, conn] of pairs) {
      if (this.drop(user, conn, server)) this.stats.evicted++;
      else this.stats.evictionsOfMoved++;
    }
  }

  serverCleaned(server) {
    this.cleaned.add(server);
    this.stats.cleaned++;
    for (const [user, e] of [...this.users]) {
      for (const [conn, s] of [...e.conns]) {
        if (s === server) {
          this.drop(user, conn, server);
          this.stats.droppedOnCleaned++;
          this.droppedOnCleaned.push([user, conn, server]);
        }
      }
    }
  }

  /** One entry of `registry:evictions` (fields as Buffers). */
  eviction(fields) {
    const type = text(fields.type);
    if (type !== 'users.evicted' && type !== 'connections.evicted' && type !== 'server.cleaned') {
      this.stats.ignored++; // not ours: acknowledged and ignored
      return;
    }
    const p = decode(fields.payload);
    if (type === 'users.evicted') this.evicted(p.server_id, p.users.map((u) => [text(u), '']));
    else if (type === 'connections.evicted') this.evicted(p.server_id, p.connections.map(([u, c]) => [text(u), text(c)]));
    else this.serverCleaned(p.server_id);
  }

  /** One entry of `presence:notices`. */
  notice(fields) {
    const n = { type: text(fields.type), user: text(fields.user), conn: text(fields.conn), server: text(fields.server), room: text(fields.room) };
    if (n.type === 'join') this.join(n);
    else if (n.type === 'leave') this.leave(n);
    else this.stats.ignored++;
  }

  view() {
    const rooms = {};
    const conns = [];
    for (const [user, e] of this.users) {
      (rooms[e.room] ??= []).push(user);
      for (const [conn, server] of e.conns) conns.push([user, conn, server]);
    }
    for (const r of Object.values(rooms)) r.sort();
    conns.sort((a, b) => (a.join(' ') < b.join(' ') ? -1 : 1));
    return { rooms, conns, stats: this.stats, droppedOnCleaned: this.droppedOnCleaned.slice(0, 100) };
  }
}

export class PresenceConsumer {
  constructor(redis, { keyPrefix = '', consumer = `${os.hostname()}-${process.pid}` } = {}) {
    this.redis = redis;
    this.K = keys(keyPrefix);
    this.consumer = consumer;
    this.presence = new Presence();
    this.last = { [this.K.notices]: '0-0', [this.K.evictions]: '0-0' };
  }

  async ensureGroups() {
    // From id 0: nothing written before the group existed is missed.
    for (const stream of [this.K.notices, this.K.evictions]) {
      try {
        await this.redis.sendCommand(['XGROUP', 'CREATE', stream, GROUP, '0', 'MKSTREAM']);
      } catch (err) {
        if (!String(err.message).includes('BUSYGROUP')) throw err;
      }
    }
  }

  /** Reads and handles one batch; returns the number of entries handled. */
  async poll(blockMs) {
    const args = ['XREADGROUP', 'GROUP', GROUP, this.consumer, 'COUNT', '500'];
    if (blockMs != null) args.push('BLOCK', String(blockMs));
    args.push('STREAMS', this.K.notices, this.K.evictions, '>', '>');
    const reply = await this.redis.sendCommand(args, BUFFERS);
    if (!reply) return 0;
    let handled = 0;
    for (const [rawStream, entries] of reply) {
      const stream = text(rawStream);
      const ids = [];
      for (const [rawId, flat] of entries) {
        const id = text(rawId);
        const fields = {};
        for (let i = 0; i + 1 < flat.length; i += 2) fields[text(flat[i])] = flat[i + 1];
        try {
          if (stream === this.K.evictions) this.presence.eviction(fields);
          else this.presence.notice(fields);
        } catch (err) {
          process.stderr.write(`presence: entry ${id} of ${stream} not understood: ${err.message}\n`);
        }
        this.presence.stats.entries++;
        ids.push(id);
        this.last[stream] = id;
        handled++;
      }
      // Acknowledged once handled.
      if (ids.length) await this.redis.sendCommand(['XACK', stream, GROUP, ...ids]);
    }
    return handled;
  }

  caughtUp(until) {
    return Object.entries(until).every(([stream, id]) => !id || cmpId(this.last[stream] ?? '0-0', id) >= 0);
  }
}

const isMain = import.meta.url === `file://${process.argv[1]}`;
if (isMain && process.send) {
  let consumer;
  let waiting = [];
  process.on('message', async (m) => {
    if (m?.type === 'start') {
      const redis = createClient({ url: m.redisUrl });
      redis.on('error', (err) => process.stderr.write(`presence: redis error: ${err.message}\n`));
      await redis.connect();
      consumer = new PresenceConsumer(redis, { keyPrefix: m.keyPrefix });
      await consumer.ensureGroups();
      report({ type: 'consuming' });
      for (;;) {
        try {
          await consumer.poll(200);
        } catch (err) {
          process.stderr.write(`presence: ${err.message}\n`);
          await new Promise((r) => setTimeout(r, 200));
        }
        const still = [];
        for (const w of waiting) {
          if (consumer.caughtUp(w.until)) report({ type: 'view', ...consumer.presence.view() });
          else still.push(w);
        }
        waiting = still;
      }
    } else if (m?.type === 'view') {
      const until = { [consumer.K.notices]: m.until.notices, [consumer.K.evictions]: m.until.evictions };
      waiting.push({ until });
    }
  });
  process.on('disconnect', () => process.exit(0));
} else if (isMain) {
  const { values: a } = parseArgs({
    options: {
      'redis-url': { type: 'string', default: process.env.REDIS_URL ?? 'redis://127.0.0.1:6379' },
      'key-prefix': { type: 'string', default: '' },
      once: { type: 'boolean', default: false },
    },
  });
  const redis = createClient({ url: a['redis-url'] });
  await redis.connect();
  const consumer = new PresenceConsumer(redis, { keyPrefix: a['key-prefix'] });
  await consumer.ensureGroups();
  if (a.once) {
    while ((await consumer.poll()) > 0);
    console.log(JSON.stringify(consumer.presence.view().rooms, null, 1));
    await redis.close();
  } else {
    for (;;) {
      await consumer.poll(5000);
      process.stderr.write(`${JSON.stringify(consumer.presence.stats)}\n`);
    }
  }
}
