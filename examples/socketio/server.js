#!/usr/bin/env node
// A socket.io connection server that keeps to registry-janitor's protocol through the Node
// client (@registry-janitor/client):
//
// - one ConnectionServer per incarnation, under the id `<name>#<unix ms>`: started
//   (heartbeat first) before any socket is taken;
// - a socket that connects (websocket only) is registered with the user id of its
//   handshake auth (`auth.user`) and, in layout `conns`, its device id (`auth.device`) as
//   the connection id; it is told `welcome` {serverId} once the registration is written,
//   and unregistered when it disconnects;
// - messages come from the sender on the Redis pub/sub channel `deliver:<server id>` and
//   are emitted as `message` events to every socket of the user on this server;
// - join and leave notices go to the stream `presence:notices` (for the presence
//   consumer), each after its registration or unregistration was written;
// - onFenced (any call answered FENCED: this incarnation was declared dead): every socket
//   is closed and the server starts again under a new id; its clients reconnect;
// - SIGTERM: no new socket, every socket closed and unregistered, then `close()` of the
//   ConnectionServer (the rest unregistered, the liveness key and the `servers` entry
//   removed): nothing is left for the janitor, and no server.dead comes.
//
// Command line:
//   node server.js --name gw-1 [--port 0] [--redis-url redis://127.0.0.1:6379]
//     [--layout keys|conns|hash] [--key-prefix P] [--ttl-ms 1500] [--heartbeat-ms 500]
// Events for a supervisor go to the parent process (IPC) when there is one, else to stderr
// as JSON lines: listening, ready, fenced, closed.
import http from 'node:http';
import { parseArgs } from 'node:util';
import { Server } from 'socket.io';
import { createClient } from 'redis';
import { ConnectionServer, FencedError } from '@registry-janitor/client';
import { keys, report } from './lib/util.js';

const { values: args } = parseArgs({
  options: {
    name: { type: 'string', default: 'gw-1' },
    port: { type: 'string', default: '0' },
    'redis-url': { type: 'string', default: process.env.REDIS_URL ?? 'redis://127.0.0.1:6379' },
    layout: { type: 'string', default: 'keys' },
    'key-prefix': { type: 'string', default: '' },
    'ttl-ms': { type: 'string', default: '1500' },
    'heartbeat-ms': { type: 'string', default: '500' },
  },
});
const name = args.name;
const layout = args.layout;
const ttlMs = Number(args['ttl-ms']);
const heartbeatIntervalMs = Number(args['heartbeat-ms']);
const K = keys(args['key-prefix']);
const log = (...a) => process.stderr.write(`[${name} ${new Date().toISOString()}] ${a.join(' ')}\n`);

const redis = createClient({ url: args['redis-url'] });
const sub = redis.duplicate();
for (const c of [redis, sub]) c.on('error', (err) => log('redis error:', err.message));
await redis.connect();
await sub.connect();

const stats = { registered: 0, unregistered: 0, delivered: 0, undeliverable: 0, refusedAtConnect: 0, incarnations: 0 };

/** One incarnation: a ConnectionServer under one server id and the sockets it holds. */
class Incarnation {
  constructor(serverId) {
    this.serverId = serverId;
    this.cs = null;
    this.sockets = new Set();
    this.byUser = new Map(); // user -> Set<socket>
    this.latest = new Map(); // registry key (user, or user + device) -> newest socket
    this.pending = new Set(); // unregistrations in flight
    this.fenced = false;
    this.closing = false;
  }
}

let current = null; // the incarnation that takes new sockets
let readyWaiters = [];

function whenReady() {
  if (current && !current.fenced) return Promise.resolve(current);
  return new Promise((resolve) => readyWaiters.push(resolve));
}

async function startIncarnation() {
  for (let attempt = 1; ; attempt++) {
    // A new server id per incarnation, `gw-1#<unix ms>` (never the same twice).
    const inc = new Incarnation(ConnectionServer.newServerId(name));
    try {
      // Subscribed before the first heartbeat: the Router may return this id from then on.
      await sub.subscribe(K.deliver(inc.serverId), (raw) => deliver(inc, raw));
      inc.cs = new ConnectionServer(redis, {
        serverId: inc.serverId,
        layout,
        keyPrefix: args['key-prefix'],
        ttlMs,
        heartbeatIntervalMs,
        onFenced: (err) => onFenced(inc, err),
        onHeartbeatLost: ({ forMs, error }) => log(`heartbeats failing for ${forMs} ms: ${error?.message ?? error}`),
        onHeartbeatRestored: () => log('heartbeats succeed again'),
      });
      await inc.cs.start();
      stats.incarnations++;
      current = inc;
      const waiters = readyWaiters;
      readyWaiters = [];
      for (const w of waiters) w(inc);
      log(`ready as ${inc.serverId}`);
      report({ type: 'ready', name, serverId: inc.serverId, at: Date.now() });
      return inc;
    } catch (err) {
      log(`start of ${inc.serverId} failed (attempt ${attempt}): ${err.message}`);
      await sub.unsubscribe(K.deliver(inc.serverId)).catch(() => {});
      await new Promise((r) => setTimeout(r, Math.min(2000, 100 * attempt)));
    }
  }
}

function onFenced(inc, err) {
  if (inc.fenced) return;
  inc.fenced = true;
  const at = Date.now();
  log(`FENCED as ${inc.serverId}: ${err?.message ?? err}; closing ${inc.sockets.size} sockets, starting again`);
  report({ type: 'fenced', name, serverId: inc.serverId, at, sockets: inc.sockets.size, message: String(err?.message ?? err) });
  sub.unsubscribe(K.deliver(inc.serverId)).catch(() => {});
  for (const socket of [...inc.sockets]) socket.disconnect(true);
  if (current === inc && !shuttingDown) startIncarnation();
}

function registryKey(user, device) {
  return layout === 'conns' ? `${user}\u0000${device}` : user;
}

function notice(type, inc, user, device, room) {
  // A stream, not pub/sub, so that a consumer that is behind loses nothing.
  return redis
    .xAdd(K.notices, '*', { type, user, conn: layout === 'conns' ? device : '', server: inc.serverId, room: room ?? '', at: String(Date.now()) })
    .catch((err) => log(`notice ${type} failed: ${err.message}`));
}

function deliver(inc, raw) {
  let m;
  try {
    m = JSON.parse(raw);
  } catch {
    return;
  }
  const sockets = inc.byUser.get(m.user);
  if (!sockets || sockets.size === 0 || inc.fenced) {
    stats.undeliverable++;
    return;
  }
  for (const socket of sockets) socket.emit('message', m);
  stats.delivered++;
}

const httpServer = http.createServer((req, res) => {
  res.writeHead(404).end();
});
const io = new Server(httpServer, {
  transports: ['websocket'],
  // socket.io's defaults (ping every 25 s, 20 s to answer): a server frozen for a few
  // seconds keeps its clients, which is what makes it a zombie when it wakes up.
  pingInterval: 25_000,
  pingTimeout: 20_000,
  serveClient: false,
});

io.use(async (socket, next) => {
  const { user, device, room } = socket.handshake.auth ?? {};
  if (typeof user !== 'string' || user.length === 0) return next(new Error('auth.user is required'));
  if (layout === 'conns' && (typeof device !== 'string' || device.length === 0)) return next(new Error('auth.device is required in layout conns'));
  if (shuttingDown) return next(new Error('shutting down'));
  socket.data.user = user;
  socket.data.device = device ?? '';
  socket.data.room = room ?? '';
  socket.data.inc = await whenReady();
  next();
});

io.on('connection', (socket) => {
  const inc = socket.data.inc;
  const { user, device, room } = socket.data;
  const key = registryKey(user, device);
  if (inc.fenced || inc.closing) {
    socket.disconnect(true);
    return;
  }
  inc.sockets.add(socket);
  if (!inc.byUser.has(user)) inc.byUser.set(user, new Set());
  inc.byUser.get(user).add(socket);
  inc.latest.set(key, socket);
  // Resolves to true once registered, false if refused or failed (never rejects).
  socket.data.registered = (layout === 'conns' ? inc.cs.register(user, device) : inc.cs.register(user)).then(
    () => {
      stats.registered++;
      if (socket.connected) socket.emit('welcome', { serverId: inc.serverId });
      notice('join', inc, user, device, room);
      return true;
    },
    (err) => {
      stats.refusedAtConnect++;
      if (!(err instanceof FencedError || err?.code === 'FENCED')) log(`register ${user} ${device} failed: ${err.message}`);
      socket.disconnect(true);
      return false;
    },
  );
  socket.on('disconnect', () => onDisconnect(inc, socket, key));
});

async function onDisconnect(inc, socket, key) {
  const { user, device, room } = socket.data;
  inc.sockets.delete(socket);
  const set = inc.byUser.get(user);
  if (set) {
    set.delete(socket);
    if (set.size === 0) inc.byUser.delete(user);
  }
  // A newer socket of the same user (and device) on this incarnation owns the entry now:
  // unregistering would delete its registration.
  const newest = inc.latest.get(key) === socket;
  if (newest) inc.latest.delete(key);
  const p = (async () => {
    if (!(await socket.data.registered) || !newest || inc.fenced) return;
    try {
      await (layout === 'conns' ? inc.cs.unregister(user, device) : inc.cs.unregister(user));
      stats.unregistered++;
      notice('leave', inc, user, device, room);
    } catch (err) {
      if (!(err instanceof FencedError || err?.code === 'FENCED')) log(`unregister ${user} ${device} failed: ${err.message}`);
    }
  })();
  inc.pending.add(p);
  p.finally(() => inc.pending.delete(p));
}

let shuttingDown = false;
async function shutdown(signal) {
  if (shuttingDown) return;
  shuttingDown = true;
  const started = Date.now();
  const inc = current;
  log(`${signal}: closing ${inc?.sockets.size ?? 0} sockets`);
  httpServer.close();
  if (inc && !inc.fenced) {
    inc.closing = true;
    for (const socket of [...inc.sockets]) socket.disconnect(true);
    // Every socket unregistered by its own disconnect (with its leave notice); then
    // close(): whatever is left, the liveness key and the `servers` entry.
    await Promise.allSettled([...inc.pending]);
    try {
      await inc.cs.close();
    } catch (err) {
      log(`close() failed: ${err.message}`);
    }
  }
  io.close();
  report({ type: 'closed', name, serverId: inc?.serverId, at: Date.now(), tookMs: Date.now() - started, stats });
  await sub.close().catch(() => {});
  await redis.close().catch(() => {});
  log('closed');
  process.exit(0);
}
process.on('SIGTERM', () => shutdown('SIGTERM'));
process.on('SIGINT', () => shutdown('SIGINT'));
process.on('message', (m) => {
  if (m?.type === 'stats') report({ type: 'stats', name, serverId: current?.serverId, sockets: current?.sockets.size ?? 0, stats });
});

await startIncarnation();
httpServer.listen(Number(args.port), '127.0.0.1', () => {
  const { port } = httpServer.address();
  log(`listening on 127.0.0.1:${port}`);
  report({ type: 'listening', name, port, serverId: current.serverId });
});
