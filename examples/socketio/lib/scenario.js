// The whole scenario, end to end, in one layout: a private redis-server, the janitor's
// worker and reconciler, socket.io servers, 1,000+ client connections, the sender, the
// presence consumer, and three faults (SIGKILL, SIGSTOP then SIGCONT, SIGTERM). Returns
// what it measured and observed; lib/checks.js judges it.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createClient, RESP_TYPES } from 'redis';
import { decode } from '@msgpack/msgpack';
import { Router } from '@registry-janitor/client';
import { keys, sleep, waitUntil } from './util.js';
import { ask, exited, nextMessage, startJanitor, startNode, startRedis, stopAll } from './procs.js';

const BYTES = { typeMapping: { [RESP_TYPES.BLOB_STRING]: Buffer } };

export const DEFAULTS = {
  layout: 'keys',
  connections: 1000,
  keyPrefix: '',
  ttlMs: 3000, // liveness TTL of the servers' key (the Node client's default)
  heartbeatMs: 500, // heartbeat interval: a process stalled up to 2.5 s keeps its liveness
  graceMs: 3000, // heartbeat_grace_ms: dead once both the TTL and the grace have passed
  reconcileIntervalMs: 500, // reconcile_interval_ms
  sendEveryMs: 3, // the sender: one message every few ms
  phaseTimeoutMs: 60_000, // the longest any wait of a phase may take before the run fails
  termQuietMs: 5_000, // after a SIGTERM, how long to watch for a wrong server.dead
};

export async function runScenario(options = {}) {
  const o = { ...DEFAULTS, ...options };
  const log = o.log ?? ((...a) => process.stderr.write(`[scenario ${o.layout}] ${a.join(' ')}\n`));
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), `socketio-${o.layout}-`));
  const K = keys(o.keyPrefix);
  const result = { layout: o.layout, dir, settings: { ...o, log: undefined }, phases: {}, startedAt: Date.now() };
  let admin;
  let ok = false;
  try {
    await run(o, log, dir, K, result, (c) => {
      admin = c;
    });
    ok = true;
    return result;
  } finally {
    stopAll();
    await admin?.close().catch(() => {});
    result.tookMs = Date.now() - result.startedAt;
    // A verdict much later than the settings allow is worth a look at the janitor's logs.
    const slow = Object.values(result.phases).some((p) => p.verdictMs > Math.max(o.ttlMs, o.graceMs) + 2000);
    if (ok && !o.keep && !slow) fs.rmSync(dir, { recursive: true, force: true });
    else log(`logs kept in ${dir}`);
  }
}

async function run(o, log, dir, K, result, setAdmin) {
  const T = o.phaseTimeoutMs;

  // --- Redis, the janitor, the presence consumer ----------------------------------------
  const redisInfo = await startRedis(dir);
  log(`redis-server on port ${redisInfo.port}, logs in ${dir}`);
  const admin = createClient({ url: redisInfo.url });
  admin.on('error', (err) => log('admin redis error:', err.message));
  await admin.connect();
  setAdmin(admin);
  const router = new Router(admin, { layout: o.layout, keyPrefix: o.keyPrefix });

  const janitorEnv = {
    JANITOR_REDIS_URL: redisInfo.url,
    JANITOR_LAYOUT: o.layout,
    JANITOR_KEY_PREFIX: o.keyPrefix,
    JANITOR_HEARTBEAT_GRACE_MS: String(o.graceMs),
    JANITOR_RECONCILE_INTERVAL_MS: String(o.reconcileIntervalMs),
    JANITOR_KEYSPACE_EVENTS_AUTO: 'true',
    JANITOR_BLOCK_MS: '500',
    JANITOR_METRICS_ADDR: 'off',
    JANITOR_LOG_FORMAT: 'text',
    RUST_LOG: process.env.RUST_LOG ?? 'info',
  };
  const worker = startJanitor('worker', { dir, env: janitorEnv });
  const reconciler = startJanitor('reconcile', { dir, env: janitorEnv });
  await waitUntil('the worker to create its consumer group', async () => {
    if (worker.exitCode !== null) throw new Error(`registry-janitor worker exited with ${worker.exitCode}; see ${dir}/janitor-worker.log`);
    if (reconciler.exitCode !== null) throw new Error(`registry-janitor reconcile exited with ${reconciler.exitCode}; see ${dir}/janitor-reconcile.log`);
    return (await groupInfo(admin, K.events, 'registry-janitor')) != null;
  }, { timeoutMs: T });

  const presence = startNode('presence.js', [], { dir, tag: 'presence' });
  await ask(presence, { type: 'start', redisUrl: redisInfo.url, keyPrefix: o.keyPrefix }, 'consuming', { timeoutMs: T });

  // --- Servers -------------------------------------------------------------------------
  const servers = new Map(); // name -> {name, child, port, url, serverId, ids[], events[]}
  const deadIds = new Set(); // incarnations killed, frozen or shut down: no client may stay on one
  async function startServer(name) {
    const child = startNode(
      'server.js',
      ['--name', name, '--redis-url', redisInfo.url, '--layout', o.layout, '--key-prefix', o.keyPrefix, '--ttl-ms', String(o.ttlMs), '--heartbeat-ms', String(o.heartbeatMs)],
      { dir, tag: name },
    );
    const s = { name, child, ids: [], events: [], live: true };
    child.on('message', (m) => {
      s.events.push(m);
      if (m.type === 'ready') {
        s.serverId = m.serverId;
        s.ids.push(m.serverId);
      }
    });
    const listening = await nextMessage(child, (m) => m.type === 'listening', { timeoutMs: T, what: `${name} to listen` });
    s.port = listening.port;
    s.url = `http://127.0.0.1:${listening.port}`;
    s.serverId = listening.serverId;
    if (!s.ids.includes(s.serverId)) s.ids.push(s.serverId);
    servers.set(name, s);
    log(`${name} up as ${s.serverId} on port ${s.port}`);
    return s;
  }
  const liveList = () => [...servers.values()].filter((s) => s.live).map((s) => ({ name: s.name, url: s.url }));
  for (const name of ['gw-1', 'gw-2', 'gw-3']) await startServer(name);

  // --- Users and clients -----------------------------------------------------------------
  const users = [];
  if (o.layout === 'conns') {
    // 4 in 5 users; every 4th of them with two devices: connections = users * 1.25.
    const n = Math.round(o.connections * 0.8);
    for (let i = 0; i < n; i++) users.push({ index: i, user: `u${String(i).padStart(5, '0')}`, room: `room-${i % 10}`, devices: i % 4 === 0 ? 2 : 1 });
  } else {
    for (let i = 0; i < o.connections; i++) users.push({ index: i, user: `u${String(i).padStart(5, '0')}`, room: `room-${i % 10}`, devices: 1 });
  }
  const total = users.reduce((a, u) => a + u.devices, 0);
  result.connections = total;
  result.users = users.length;
  result.twoDeviceUsers = users.filter((u) => u.devices === 2).length;

  const clients = startNode('clients.js', [], { dir, tag: 'clients' });
  const t0 = Date.now();
  await ask(clients, { type: 'start', servers: liveList(), users }, 'started', { timeoutMs: T });
  const snap = () => ask(clients, { type: 'snapshot' }, 'snapshot', { timeoutMs: T });
  await waitUntil(`${total} connections registered`, async () => (await snap()).counts.connected === total, { timeoutMs: T * 2, everyMs: 200 });
  result.allConnectedMs = Date.now() - t0;
  log(`${total} connections (${users.length} users) registered in ${result.allConnectedMs} ms`);

  // Every connected client routes to its current server; exactly (no other server) when
  // `exact`. Returns the clients that do not, with what the Router said.
  async function unroutable(s, { exact = false } = {}) {
    const byUser = new Map();
    for (const c of s.clients) {
      if (!byUser.has(c.user)) byUser.set(c.user, []);
      byUser.get(c.user).push(c);
    }
    const names = [...byUser.keys()];
    const routes = o.layout === 'conns' ? await router.routeUsers(names) : (await router.routeMany(names)).map((x) => (x ? [x] : []));
    const bad = [];
    names.forEach((user, i) => {
      const cs = byUser.get(user);
      const connected = cs.filter((c) => c.state === 'connected');
      // A client still on a dead server has not noticed its loss yet: not routable.
      const pending = cs.filter((c) => c.state === 'connecting' || (c.state === 'connected' && deadIds.has(c.serverId)));
      const want = [...new Set(connected.map((c) => c.serverId))].sort();
      const got = routes[i];
      if (pending.length) bad.push({ user, want, got, pending: pending.length });
      else if (want.some((w) => !got.includes(w))) bad.push({ user, want, got });
      else if (exact && (got.length !== want.length || got.some((g) => !want.includes(g)))) bad.push({ user, want, got });
    });
    return bad;
  }
  /** Waits until every client that should be connected is registered and routable. */
  async function allRoutable(what, since, opts) {
    let last = [];
    await waitUntil(what, async () => {
      last = await unroutable(await snap(), opts);
      return last.length === 0;
    }, { timeoutMs: T, everyMs: 100 }).catch((err) => {
      throw new Error(`${err.message}; e.g. ${JSON.stringify(last.slice(0, 3))}`);
    });
    return Date.now() - since;
  }
  result.initialRoutableMs = await allRoutable('every client routable at start', t0, { exact: true });

  // --- The sender, two more servers -----------------------------------------------------
  const sender = startNode('sender.js', [], { dir, tag: 'sender' });
  await ask(sender, { type: 'start', redisUrl: redisInfo.url, layout: o.layout, keyPrefix: o.keyPrefix, users: users.map((u) => u.user), intervalMs: o.sendEveryMs }, 'sending', { timeoutMs: T });
  for (const name of ['gw-4', 'gw-5']) await startServer(name);
  clients.send({ type: 'servers', list: liveList() });
  await sleep(1000);

  const victims = [];

  // --- Fault 1: SIGKILL -----------------------------------------------------------------
  {
    const s = servers.get('gw-1');
    const id = s.serverId;
    const before = await snap();
    const on = before.clients.filter((c) => c.serverId === id);
    clients.send({ type: 'fault', serverId: id, mode: 'kill' });
    s.live = false;
    clients.send({ type: 'servers', list: liveList() });
    deadIds.add(id);
    const faultAt = Date.now();
    s.child.kill('SIGKILL');
    log(`SIGKILL ${id} (${on.length} connections)`);
    const phase = { mode: 'kill', name: s.name, serverId: id, faultAt, connections: on.length, policies: countBy(on, 'policy') };
    result.phases.kill = phase;
    victims.push(phase);
    // Its clients reconnect (all but the gone and the late): routable again.
    phase.reRoutableMs = await allRoutable('the SIGKILLed server\'s clients routable elsewhere', faultAt);
    await verdictAndCleanup(phase);
    phase.lastReRegisteredMs = lastReRegistered(await snap(), id, faultAt, 'now');
    phase.moves = moveStats(await snap(), id, faultAt, 'now');
    // The late ones come back after the cleanup.
    const releasedAt = Date.now();
    const rel = await ask(clients, { type: 'release' }, 'released', { timeoutMs: T });
    phase.lateReleased = rel.count;
    phase.lateRoutableAfterReleaseMs = await allRoutable('the late clients routable', releasedAt);
    phase.leftovers = await leftovers(id);
    log(`kill: verdict ${phase.verdictMs} ms after SIGKILL, clients routable after ${phase.reRoutableMs} ms, acknowledged after ${phase.ackedMs} ms`);
  }

  // --- Fault 2: SIGSTOP past the TTL and the grace, then SIGCONT: a zombie ----------------
  {
    const s = servers.get('gw-2');
    const id = s.serverId;
    const before = await snap();
    const on = before.clients.filter((c) => c.serverId === id);
    clients.send({ type: 'fault', serverId: id, mode: 'stop' });
    s.live = false; // the load balancer's health check takes it out
    clients.send({ type: 'servers', list: liveList() });
    deadIds.add(id);
    const faultAt = Date.now();
    s.child.kill('SIGSTOP');
    log(`SIGSTOP ${id} (${on.length} connections)`);
    const phase = { mode: 'stop', name: s.name, serverId: id, faultAt, connections: on.length, policies: countBy(on, 'policy') };
    result.phases.stop = phase;
    victims.push(phase);
    await verdictAndCleanup(phase);
    await sleep(Math.max(0, faultAt + o.ttlMs + o.graceMs + 1000 - Date.now()));
    const contAt = Date.now();
    phase.contAt = contAt;
    phase.stoppedForMs = contAt - faultAt;
    const fenced = nextMessage(s.child, (m) => m.type === 'fenced' && m.serverId === id, { timeoutMs: T, what: `${id} to learn FENCED` });
    const ready = nextMessage(s.child, (m) => m.type === 'ready' && m.serverId !== id, { timeoutMs: T, what: `${s.name} to start again` });
    s.child.kill('SIGCONT');
    log(`SIGCONT ${id} after ${phase.stoppedForMs} ms`);
    const f = await fenced;
    phase.fencedLearnedMs = f.at - contAt;
    phase.socketsClosedOnFence = f.sockets;
    const r = await ready;
    phase.newServerId = r.serverId;
    phase.newIdUpMs = r.at - contAt;
    s.live = true;
    clients.send({ type: 'servers', list: liveList() });
    phase.reRoutableMs = await allRoutable('the zombie\'s clients routable elsewhere', contAt);
    phase.lastReRegisteredMs = lastReRegistered(await snap(), id, contAt, 'now');
    phase.moves = moveStats(await snap(), id, contAt, 'now');
    const releasedAt = Date.now();
    const rel = await ask(clients, { type: 'release' }, 'released', { timeoutMs: T });
    phase.lateReleased = rel.count;
    phase.lateRoutableAfterReleaseMs = await allRoutable('the late clients routable', releasedAt);
    await drained();
    phase.refused = await admin.hGetAll(K.server(id, 'refused'));
    phase.leftovers = await leftovers(id);
    log(`stop: verdict ${phase.verdictMs} ms after SIGSTOP, FENCED learned ${phase.fencedLearnedMs} ms after SIGCONT, back as ${phase.newServerId}`);
  }

  // --- Fault 3: SIGTERM: a clean leave ----------------------------------------------------
  {
    const s = servers.get('gw-3');
    const id = s.serverId;
    const before = await snap();
    const on = before.clients.filter((c) => c.serverId === id);
    clients.send({ type: 'fault', serverId: id, mode: 'term' });
    s.live = false;
    clients.send({ type: 'servers', list: liveList() });
    deadIds.add(id);
    const faultAt = Date.now();
    const closed = nextMessage(s.child, (m) => m.type === 'closed', { timeoutMs: T, what: `${id} to close` });
    s.child.kill('SIGTERM');
    log(`SIGTERM ${id} (${on.length} connections)`);
    const phase = { mode: 'term', name: s.name, serverId: id, faultAt, connections: on.length };
    result.phases.term = phase;
    victims.push(phase);
    const c = await closed;
    phase.closedAt = c.at;
    phase.closedMs = c.at - faultAt;
    phase.exit = await exited(s.child);
    phase.reRoutableMs = await allRoutable('the SIGTERMed server\'s clients routable elsewhere', faultAt);
    phase.lastReRegisteredMs = lastReRegistered(await snap(), id, faultAt, null);
    phase.moves = moveStats(await snap(), id, faultAt, null);
    // Long enough for the reconciler to call it dead if anything of it were left.
    await sleep(Math.max(o.termQuietMs, o.ttlMs + o.graceMs + 2 * o.reconcileIntervalMs + 1000));
    phase.keysLeft = await scanKeys(`${o.keyPrefix}server:{${id}}:*`);
    phase.movedMembers = await admin.zCard(K.server(id, 'moved'));
    phase.movedTtlMs = await admin.pTTL(K.server(id, 'moved'));
    phase.inServers = (await admin.zScore(K.servers, id)) != null;
    phase.entriesNaming = await entriesNaming(id);
    phase.deadEvents = (await deadEvents()).filter((e) => e.server_id === id).length;
    log(`term: closed in ${phase.closedMs} ms, ${phase.keysLeft.length} keys left, ${phase.deadEvents} server.dead`);
  }

  // --- The end: quiet, then compare ---------------------------------------------------------
  result.finalRoutableMs = await allRoutable('every client routable at the end (exactly)', Date.now(), { exact: true });
  const records = await ask(sender, { type: 'stop' }, 'records', { timeoutMs: T });
  const final = await snap();
  result.finalCounts = final.counts;
  await drained();
  result.janitor = {
    pending: (await admin.xPending(K.events, 'registry-janitor')).pending,
    group: await groupInfo(admin, K.events, 'registry-janitor'),
    deadLetters: await admin.xLen(`${K.events}:dead`),
    events: await deadEvents(),
  };
  // A verdict on a server that was not faulted: a false positive, which a process stalled
  // past the TTL and the grace on an overloaded machine can earn. It is the protocol's
  // business too: that server must learn FENCED and come back under a new id; and the
  // Router must never return it after the verdict, as for the others.
  const faulted = new Set(victims.map((v) => v.serverId));
  result.falsePositives = [];
  for (const e of result.janitor.events) {
    if (faulted.has(e.server_id) || result.falsePositives.some((f) => f.serverId === e.server_id)) continue;
    const s = [...servers.values()].find((x) => x.ids.includes(e.server_id));
    const learned = s?.events.find((m) => m.type === 'fenced' && m.serverId === e.server_id);
    const next = s ? s.ids[s.ids.indexOf(e.server_id) + 1] : undefined;
    const verdictAt = Number(await admin.hGet(K.server(e.server_id, 'fenced'), 'fenced_at_ms'));
    result.falsePositives.push({ serverId: e.server_id, name: s?.name, verdictAt, learnedFencedMs: learned ? learned.at - verdictAt : null, backAs: next ?? null });
    victims.push({ mode: 'false positive', serverId: e.server_id, faultAt: verdictAt, verdictAt });
  }
  result.messages = classify(records, victims);
  const delivered = new Map((await ask(clients, { type: 'delivered' }, 'delivered', { timeoutMs: T })).received);
  result.messages.delivery = deliveryStats(records.records, victims, delivered);

  // The presence consumer, once it has read both streams to their ends.
  const until = { notices: await lastId(K.notices), evictions: await lastId(K.evictions) };
  const view = await ask(presence, { type: 'view', until }, 'view', { timeoutMs: T });
  result.presence = comparePresence(view, final, o.layout);
  result.presence.stats = view.stats;
  result.presence.evictionEntries = await evictionSummary();
  // Connections the consumer dropped only on `server.cleaned` (no eviction or leave had
  // removed them): what the two streams said about each, in the order of each stream.
  result.presence.droppedOnCleaned = [];
  for (const [user, conn, server] of view.droppedOnCleaned) {
    const notices = (await admin.xRange(K.notices, '-', '+')).filter((e) => e.message.user === user).map((e) => `${e.id} ${e.message.type} ${e.message.conn} ${e.message.server}`);
    const announced = (await evictedPairs()).filter((x) => x.user === user).map((x) => `${x.id} ${x.source} ${x.conn} ${x.server}`);
    result.presence.droppedOnCleaned.push({ user, conn, server, notices, announced });
  }

  // Gone users (their every connection never came back) must be out of presence and
  // unroutable; the late ones back.
  const gone = new Set(final.clients.filter((c) => c.state === 'gone').map((c) => c.user));
  for (const c of final.clients) if (c.state !== 'gone') gone.delete(c.user);
  result.goneUsers = gone.size;
  const goneRoutes = o.layout === 'conns' ? await router.routeUsers([...gone]) : (await router.routeMany([...gone])).map((x) => (x ? [x] : []));
  result.goneRoutable = goneRoutes.filter((r) => r.length).length;

  // Stop the rest cleanly: servers by SIGTERM (each leaves nothing behind), then the janitor.
  clients.send({ type: 'stop' });
  for (const s of servers.values()) if (s.live) s.child.kill('SIGTERM');
  await Promise.all([...servers.values()].filter((s) => s.live).map((s) => exited(s.child)));
  worker.kill('SIGTERM');
  reconciler.kill('SIGTERM');
  result.janitorExit = { worker: await exited(worker), reconcile: await exited(reconciler) };
  result.remainingAfterShutdown = await admin.zRange(K.servers, 0, -1);
  return result;

  // --- helpers over `admin` ------------------------------------------------------------------
  async function verdictAndCleanup(phase) {
    const id = phase.serverId;
    const fenced = await waitUntil(`the verdict on ${id}`, async () => {
      const at = await admin.hGet(K.server(id, 'fenced'), 'fenced_at_ms');
      return at ? Number(at) : null;
    }, { timeoutMs: T, everyMs: 20 });
    phase.verdictAt = fenced;
    phase.verdictMs = fenced - phase.faultAt;
    const ev = (await deadEvents()).filter((e) => e.server_id === id);
    phase.deadEvents = ev.length;
    phase.publishedMs = ev.length ? ev[0].publishedAt - phase.faultAt : null;
    phase.source = ev[0]?.source;
    const cleaned = await waitUntil(`server.cleaned for ${id}`, async () => (await evictionSummary()).cleaned.find((c) => c.server_id === id), { timeoutMs: T, everyMs: 50 });
    phase.ackedMs = cleaned.cleaned_at_ms - phase.faultAt;
    phase.cleanupMs = cleaned.cleaned_at_ms - fenced;
    phase.evictedEntries = cleaned.deleted;
    phase.keptEntries = cleaned.kept;
    await drained();
    // Announced on the evictions stream, by the cleanup and by the drift sweep (which may
    // reach an entry of the dead server first: its owner is past its liveness and grace).
    const by = (await evictionSummary()).bySource;
    phase.announced = { cleanup: by[`${id} cleanup`] ?? 0, sweep: by[`${id} sweep`] ?? 0 };
  }

  async function drained() {
    await waitUntil('the janitor group to have nothing pending', async () => {
      const g = await groupInfo(admin, K.events, 'registry-janitor');
      const p = await admin.xPending(K.events, 'registry-janitor');
      return g && p.pending === 0 && (g.lag == null || g.lag === 0);
    }, { timeoutMs: T, everyMs: 50 });
  }

  async function scanKeys(match) {
    const found = [];
    for await (const batch of admin.scanIterator({ MATCH: match, COUNT: 1000 })) found.push(...batch);
    return found;
  }

  /** Forward entries that still name `id`. */
  async function entriesNaming(id) {
    const naming = [];
    if (o.layout === 'conns') {
      const ks = await scanKeys(`${o.keyPrefix}user:{*}:conns`);
      const all = await Promise.all(ks.map((k) => admin.hGetAll(k)));
      ks.forEach((k, i) => {
        for (const [conn, server] of Object.entries(all[i])) if (server === id) naming.push(`${k} ${conn}`);
      });
    } else if (o.layout === 'keys') {
      const ks = (await scanKeys(`${o.keyPrefix}user:*`)).filter((k) => !k.endsWith(':conns'));
      const vals = ks.length ? await admin.mGet(ks) : [];
      ks.forEach((k, i) => {
        if (vals[i] === id) naming.push(k);
      });
    } else {
      for (const [user, server] of Object.entries(await admin.hGetAll(K.registry))) if (server === id) naming.push(user);
    }
    return naming;
  }

  /** What is left of a dead server once its event is acknowledged. The fence and the
   * refusal notes stay by design (they outlive the server); nothing else may. */
  async function leftovers(id) {
    const allowed = new Set(['fenced', 'refused', 'reported'].map((w) => K.server(id, w)));
    const ks = await scanKeys(`${o.keyPrefix}server:{${id}}:*`);
    return {
      keys: ks.filter((k) => !allowed.has(k)),
      kept: ks.filter((k) => allowed.has(k)).sort(),
      inServers: (await admin.zScore(K.servers, id)) != null,
      entriesNaming: await entriesNaming(id),
      fenced: (await admin.exists(K.server(id, 'fenced'))) === 1,
    };
  }

  async function deadEvents() {
    const out = [];
    // Payloads are MessagePack: read as bytes.
    const raw = (await admin.sendCommand(['XRANGE', K.events, '-', '+'], BYTES)) ?? [];
    for (const [id, flat] of raw) {
      const f = {};
      for (let i = 0; i + 1 < flat.length; i += 2) f[flat[i].toString()] = flat[i + 1];
      if (f.type?.toString() !== 'server.dead') continue;
      const p = decode(f.payload);
      out.push({ id: id.toString(), publishedAt: Number(id.toString().split('-')[0]), server_id: p.server_id, source: p.source, reason: p.reason });
    }
    return out;
  }

  async function evictionSummary() {
    const raw = (await admin.sendCommand(['XRANGE', K.evictions, '-', '+'], BYTES)) ?? [];
    const s = { usersEvicted: 0, connectionsEvicted: 0, entries: 0, cleaned: [], bySource: {} };
    for (const [, flat] of raw) {
      const f = {};
      for (let i = 0; i + 1 < flat.length; i += 2) f[flat[i].toString()] = flat[i + 1];
      const type = f.type?.toString();
      const p = decode(f.payload);
      s.entries++;
      if (type === 'users.evicted' || type === 'connections.evicted') {
        const n = type === 'users.evicted' ? p.users.length : p.connections.length;
        if (type === 'users.evicted') s.usersEvicted += n;
        else s.connectionsEvicted += n;
        const k = `${p.server_id} ${p.source}`;
        s.bySource[k] = (s.bySource[k] ?? 0) + n;
      }
      else if (type === 'server.cleaned') s.cleaned.push({ server_id: p.server_id, deleted: Number(p.deleted), kept: Number(p.kept), cleaned_at_ms: Number(p.cleaned_at_ms) });
    }
    return s;
  }

  async function evictedPairs() {
    const raw = (await admin.sendCommand(['XRANGE', K.evictions, '-', '+'], BYTES)) ?? [];
    const out = [];
    for (const [id, flat] of raw) {
      const f = {};
      for (let i = 0; i + 1 < flat.length; i += 2) f[flat[i].toString()] = flat[i + 1];
      const type = f.type?.toString();
      const p = decode(f.payload);
      if (type === 'users.evicted') for (const u of p.users) out.push({ id: id.toString(), source: p.source, server: p.server_id, user: Buffer.from(u).toString(), conn: '' });
      if (type === 'connections.evicted') for (const [u, c] of p.connections) out.push({ id: id.toString(), source: p.source, server: p.server_id, user: Buffer.from(u).toString(), conn: String(c) });
    }
    return out;
  }

  async function lastId(stream) {
    const r = await admin.xRevRange(stream, '+', '-', { COUNT: 1 });
    return r.length ? r[0].id : '0-0';
  }
}

function countBy(list, key) {
  const out = {};
  for (const x of list) out[x[key]] = (out[x[key]] ?? 0) + 1;
  return out;
}

/** The longest time from `since` to the re-registration of a client that lost `id`
 * (only clients of `policy` when given). */
function lastReRegistered(snapshot, id, since, policy) {
  const times = [];
  for (const c of snapshot.clients) {
    if (policy && c.policy !== policy) continue;
    for (const m of c.moves) {
      if (m.from === id && m.registeredAt != null) times.push(m.registeredAt - since);
    }
  }
  return times.length ? Math.max(...times) : null;
}

/** Distribution of the times from `since` to the loss and to the re-registration of the
 * clients that lost `id`. */
function moveStats(snapshot, id, since, policy) {
  const lost = [];
  const back = [];
  for (const c of snapshot.clients) {
    if (policy && c.policy !== policy) continue;
    for (const m of c.moves) {
      if (m.from !== id) continue;
      lost.push(m.lostAt - since);
      if (m.registeredAt != null) back.push(m.registeredAt - since);
    }
  }
  const q = (xs, f) => (xs.length ? [...xs].sort((a, b) => a - b)[Math.min(xs.length - 1, Math.floor(f * xs.length))] : null);
  return { count: back.length, lostP50: q(lost, 0.5), lostMax: q(lost, 1), backP50: q(back, 0.5), backP90: q(back, 0.9), backMax: q(back, 1) };
}

async function groupInfo(admin, stream, group) {
  try {
    const groups = await admin.sendCommand(['XINFO', 'GROUPS', stream]);
    for (const g of groups) {
      const o = {};
      for (let i = 0; i + 1 < g.length; i += 2) o[g[i]] = g[i + 1];
      if (o.name === group) return { name: o.name, consumers: Number(o.consumers), pending: Number(o.pending), lag: o.lag == null ? null : Number(o.lag), lastDeliveredId: o['last-delivered-id'] };
    }
  } catch {
    // no stream yet
  }
  return null;
}

/** Messages routed to a dead (SIGKILL), frozen or fenced (SIGSTOP) server, through the
 * Router and through a plain read beside it, before and after the verdict; and routed to
 * the SIGTERMed server once it had closed. A route counts from the time it was sent:
 * after the fault and up to the verdict's millisecond is "before", later is "after". */
function classify({ records, errors, lastError }, victims) {
  const out = { sent: records.length, senderErrors: errors, senderLastError: lastError, routedNowhere: { router: 0, plain: 0 }, perVictim: [] };
  for (const r of records) {
    if (r[3].length === 0) out.routedNowhere.router++;
    if (r[4].length === 0) out.routedNowhere.plain++;
  }
  for (const v of victims) {
    const c = { serverId: v.serverId, mode: v.mode, router: { before: 0, after: 0 }, plain: { before: 0, after: 0 }, plainLastAfterVerdictMs: null, routerLastBeforeVerdictMs: null };
    for (const [sentAt, , , viaRouter, plain] of records) {
      if (sentAt < v.faultAt) continue;
      const start = v.mode === 'term' ? v.closedAt : v.faultAt;
      if (sentAt < start) continue;
      const after = v.mode === 'term' ? true : sentAt > v.verdictAt;
      const slot = v.mode === 'term' ? 'after' : after ? 'after' : 'before';
      if (viaRouter.includes(v.serverId)) {
        c.router[slot]++;
        if (!after) c.routerLastBeforeVerdictMs = sentAt - v.faultAt;
      }
      if (plain.includes(v.serverId)) {
        c.plain[slot]++;
        if (after && v.mode !== 'term') c.plainLastAfterVerdictMs = sentAt - v.verdictAt;
      }
    }
    out.perVictim.push(c);
  }
  out.router = { before: sum(out.perVictim, 'router', 'before'), after: sum(out.perVictim, 'router', 'after') };
  out.plain = { before: sum(out.perVictim, 'plain', 'before'), after: sum(out.perVictim, 'plain', 'after') };
  return out;
}
const sum = (list, a, b) => list.filter((x) => x.mode !== 'term').reduce((t, x) => t + x[a][b], 0);

/** Of the messages the Router sent to a server that was live at the time, how many some
 * device of the user received. */
function deliveryStats(records, victims, delivered) {
  let routedLive = 0;
  let got = 0;
  let routedDead = 0;
  let gotFromDead = 0;
  for (const [sentAt, , , viaRouter, , id] of records) {
    if (viaRouter.length === 0) continue;
    const dead = victims.some((v) => viaRouter.includes(v.serverId) && sentAt >= v.faultAt);
    if (dead) {
      routedDead++;
      if (delivered.has(id)) gotFromDead++;
    } else {
      routedLive++;
      if (delivered.has(id)) got++;
    }
  }
  return { routedLive, deliveredOfLive: got, routedDead, deliveredOfDead: gotFromDead };
}

/** The presence consumer's view against the truth: the connections the clients hold. */
function comparePresence(view, snapshot, layout) {
  const truthRooms = {};
  const truthConns = [];
  for (const c of snapshot.clients) {
    if (c.state !== 'connected') continue;
    (truthRooms[c.room] ??= new Set()).add(c.user);
    truthConns.push([c.user, layout === 'conns' ? c.device : '', c.serverId]);
  }
  const rooms = {};
  for (const [room, set] of Object.entries(truthRooms)) rooms[room] = [...set].sort();
  truthConns.sort((a, b) => (a.join(' ') < b.join(' ') ? -1 : 1));
  const roomDiffs = [];
  for (const room of new Set([...Object.keys(rooms), ...Object.keys(view.rooms)])) {
    const want = new Set(rooms[room] ?? []);
    const got = new Set(view.rooms[room] ?? []);
    const missing = [...want].filter((u) => !got.has(u));
    const extra = [...got].filter((u) => !want.has(u));
    if (missing.length || extra.length) roomDiffs.push({ room, missing, extra });
  }
  const key = (x) => x.join(' ');
  const wantConns = new Set(truthConns.map(key));
  const gotConns = new Set(view.conns.map(key));
  return {
    onlineUsers: Object.values(rooms).reduce((t, r) => t + r.length, 0),
    viewUsers: Object.values(view.rooms).reduce((t, r) => t + r.length, 0),
    rooms: Object.keys(rooms).length,
    roomDiffs,
    connMissing: [...wantConns].filter((k) => !gotConns.has(k)),
    connExtra: [...gotConns].filter((k) => !wantConns.has(k)),
  };
}
