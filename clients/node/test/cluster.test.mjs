// A Redis Cluster of 3 masters: the spec's step order, a registration refused at its member
// step has its forward entry taken back, a zombie writes no forward entry, the fence with
// the real worker; RESP2 and RESP3.
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { ConnectionServer, FencedError, Router, scripts, scriptShas, topologyOf } from '../dist/index.js';
import {
  cleanup, cli, clusterClient, emitServerDead, janitorBinary, nodeClient, sleep, startCluster, startWorker, waitFor,
} from './harness.mjs';

after(cleanup);

const SCRIPT_BY_SHA = Object.fromEntries(Object.entries(scriptShas).map(([name, sha]) => [sha, name]));

/** `cluster` whose commands are written down as 'COMMAND key' ('EVALSHA <script> <numkeys>'),
 * `hook(args)` awaited before each is sent. */
function recording(cluster) {
  const rec = { log: [], hook: undefined };
  const proxy = new Proxy(cluster, {
    get(target, prop) {
      const value = Reflect.get(target, prop, target);
      if (prop === 'sendCommand') {
        return async (key, readOnly, args, options) => {
          const words = args.map(String);
          if (words[0].startsWith('EVALSHA')) rec.log.push(`${words[0]} ${SCRIPT_BY_SHA[words[1]]} ${words[2]}`);
          else if (words[0] !== 'SCRIPT') rec.log.push(`${words[0]} ${words[1]}`);
          await rec.hook?.(words);
          return value.call(target, key, readOnly, args, options);
        };
      }
      return typeof value === 'function' ? value.bind(target) : value;
    },
  });
  return { proxy, rec };
}

/** Keys under `prefix` on every master. */
async function keysEverywhere(cluster, prefix) {
  const all = [];
  for (const n of cluster.nodes) {
    const out = await cli(n.port, '--scan', '--pattern', `${prefix}*`);
    if (out) all.push(...out.split('\n'));
  }
  return all.sort();
}

describe('Redis Cluster', () => {
  let cluster;
  before(async () => {
    janitorBinary();
    cluster = await startCluster();
  });

  for (const RESP of [2, 3]) {
    describe(`RESP${RESP}`, () => {
      let client;
      before(async () => {
        client = await clusterClient(cluster, RESP);
        assert.equal(topologyOf(client), 'cluster');
      });

      test('each layout: register, route, unregister, close', async () => {
        for (const layout of ['hash', 'keys', 'conns']) {
          const keyPrefix = `c${RESP}:${layout}:`;
          const opts = { layout, keyPrefix };
          const [a, b, c] = ['gw-a#1', 'gw-b#1', 'gw-c#1'].map((serverId) => new ConnectionServer(client, { serverId, ...opts }));
          for (const s of [a, b, c]) await s.start();
          const router = new Router(client, opts);
          const users = Array.from({ length: 30 }, (_, i) => `user-${i}`);
          if (layout === 'conns') {
            for (const u of users) {
              await a.register(u, 'phone');
              await b.register(u, 'tab-1');
              await b.register(u, 'tab-2');
              await c.register(u, 'laptop');
            }
            assert.deepEqual(await router.routeUser('user-0'), ['gw-a#1', 'gw-b#1', 'gw-c#1']);
            await client.hSet(`${keyPrefix}server:{gw-c#1}:fenced`, 'fenced_at_ms', '1');
            await client.del(`${keyPrefix}server:{gw-a#1}:alive`);
            assert.deepEqual(await router.routeUsers(users), users.map(() => ['gw-b#1']));
            assert.equal(await b.unregister('user-0', 'tab-1'), true);
            assert.equal(await b.unregister('user-0', 'tab-1'), false);
            await client.del(`${keyPrefix}server:{gw-c#1}:fenced`);
          } else {
            await Promise.all(users.map((u) => a.register(u)));
            await b.register('user-1');
            assert.deepEqual(await router.routeMany(['user-0', 'user-1', 'nobody']), ['gw-a#1', 'gw-b#1', null]);
            assert.equal(await a.unregister('user-1'), false, "b's entry stays");
            assert.equal(await a.unregister('user-0'), true);
            assert.equal(await router.route('user-0'), null);
            await client.hSet(`${keyPrefix}server:{gw-a#1}:fenced`, 'fenced_at_ms', '1');
            assert.equal(await router.route('user-2'), null, 'a fenced owner is not returned');
            await client.del(`${keyPrefix}server:{gw-a#1}:fenced`);
          }
          for (const s of [a, b, c]) await s.close();
          assert.deepEqual(await keysEverywhere(cluster, keyPrefix), [], `layout ${layout}: close() left nothing`);
        }
      });

      test('the step order of the spec', async () => {
        for (const n of cluster.nodes) for (const name of Object.keys(scripts)) await cli(n.port, 'SCRIPT', 'LOAD', scripts[name]);
        const { proxy, rec } = recording(client);
        const keyPrefix = `o${RESP}:`;
        const S = 'gw-order#1';
        const F = `${keyPrefix}server:{${S}}:fenced`;
        const steps = async (fn) => {
          rec.log = [];
          await fn();
          return rec.log;
        };
        const s = new ConnectionServer(proxy, { serverId: S, keyPrefix, ttlMs: 120_000 });
        assert.deepEqual(await steps(() => s.start()), ['EVALSHA heartbeat 3', `ZADD ${keyPrefix}servers`]);
        assert.deepEqual(await steps(() => s.register('alice')), [`EXISTS ${F}`, `SET ${keyPrefix}user:alice`, 'EVALSHA register 3']);
        const router = new Router(proxy, { keyPrefix });
        assert.deepEqual(await steps(async () => assert.equal(await router.route('alice'), S)), [
          `GET ${keyPrefix}user:alice`, `EXISTS ${F}`, `EXISTS ${keyPrefix}server:{${S}}:alive`,
        ]);
        assert.deepEqual(await steps(async () => assert.equal(await s.unregister('alice'), true)), ['EVALSHA release 1', 'EVALSHA unregister 3']);

        const h = new ConnectionServer(proxy, { serverId: 'gw-order-h#1', layout: 'hash', keyPrefix, ttlMs: 120_000 });
        await h.start();
        assert.deepEqual(await steps(() => h.register('bob')), [
          `EXISTS ${keyPrefix}server:{gw-order-h#1}:fenced`, `HSET ${keyPrefix}registry`, 'EVALSHA register 3',
        ]);
        assert.deepEqual(await steps(() => new Router(proxy, { layout: 'hash', keyPrefix }).route('bob')), [
          `HGET ${keyPrefix}registry`, `EXISTS ${keyPrefix}server:{gw-order-h#1}:fenced`, `EXISTS ${keyPrefix}server:{gw-order-h#1}:alive`,
        ]);

        const c = new ConnectionServer(proxy, { serverId: 'gw-order-c#1', layout: 'conns', keyPrefix, ttlMs: 120_000 });
        await c.start();
        const C = `${keyPrefix}user:{carol}:conns`;
        assert.deepEqual(await steps(() => c.register('carol', 'phone')), [
          `EXISTS ${keyPrefix}server:{gw-order-c#1}:fenced`, `HSET ${C}`, 'EVALSHA register_conn 3',
        ]);
        assert.deepEqual(await steps(() => new Router(proxy, { layout: 'conns', keyPrefix }).routeUser('carol')), [
          `HVALS ${C}`, `EXISTS ${keyPrefix}server:{gw-order-c#1}:fenced`, `EXISTS ${keyPrefix}server:{gw-order-c#1}:alive`,
        ]);
        assert.deepEqual(await steps(() => c.unregister('carol', 'phone')), ['EVALSHA release 1', 'EVALSHA unregister_conn 3']);
        for (const x of [s, h, c]) await x.close();
        assert.deepEqual(await keysEverywhere(cluster, keyPrefix), []);
      });

      test('a registration refused at its member step has its forward entry taken back', async () => {
        for (const layout of ['keys', 'hash', 'conns']) {
          const { proxy, rec } = recording(client);
          const keyPrefix = `m${RESP}:${layout}:`;
          const S = 'gw-refused#1';
          const F = `${keyPrefix}server:{${S}}:fenced`;
          const fencedCalls = [];
          const s = new ConnectionServer(proxy, { serverId: S, layout, keyPrefix, ttlMs: 120_000, onFenced: (e) => fencedCalls.push(e) });
          const live = new ConnectionServer(client, { serverId: 'gw-live#1', layout, keyPrefix });
          await s.start();
          await live.start();
          if (layout === 'conns') await live.register('dave', 'laptop'); // dave's other connection

          // The verdict lands between the fence check and the member: right before the
          // forward write goes out.
          rec.hook = async (words) => {
            if (words[0] === 'SET' || words[0] === 'HSET') {
              rec.hook = undefined;
              await client.hSet(F, 'fenced_at_ms', String(Date.now()));
            }
          };
          rec.log = [];
          const connection = layout === 'conns' ? 'phone' : undefined;
          await assert.rejects(s.register('dave', connection), FencedError);
          const write = { keys: `SET ${keyPrefix}user:dave`, hash: `HSET ${keyPrefix}registry`, conns: `HSET ${keyPrefix}user:{dave}:conns` }[layout];
          const script = layout === 'conns' ? 'register_conn' : 'register';
          assert.deepEqual(rec.log, [`EXISTS ${F}`, write, `EVALSHA ${script} 3`, 'EVALSHA release 1']);
          assert.equal(fencedCalls.length, 1);
          assert.equal(s.fenced, true);
          assert.equal(await client.exists(`${keyPrefix}server:{${S}}:users`), 0, 'no member');
          assert.equal(await client.hGet(`${keyPrefix}server:{${S}}:refused`, 'register'), '1');
          if (layout === 'keys') assert.equal(await client.exists(`${keyPrefix}user:dave`), 0, 'the forward entry was taken back');
          if (layout === 'hash') assert.equal(await client.hExists(`${keyPrefix}registry`, 'dave'), 0);
          if (layout === 'conns') {
            assert.deepEqual({ ...(await client.hGetAll(`${keyPrefix}user:{dave}:conns`)) }, { laptop: 'gw-live#1' }, "the field taken back, dave's other connection kept");
          }
          const router = new Router(client, { layout, keyPrefix });
          if (layout === 'conns') assert.deepEqual(await router.routeUser('dave'), ['gw-live#1']);
          else assert.equal(await router.route('dave'), null);

          // Later calls: refused at once, nothing sent.
          rec.log = [];
          await assert.rejects(s.register('erin', connection), FencedError);
          await assert.rejects(s.unregister('dave', connection), FencedError);
          assert.deepEqual(rec.log, []);
          await s.close();
          await live.close();
          // A fenced server's close() touches nothing: its liveness expires, and the janitor
          // (not running here) takes it out of `servers`.
          assert.deepEqual(await keysEverywhere(cluster, keyPrefix), [
            `${keyPrefix}server:{${S}}:alive`, F, `${keyPrefix}server:{${S}}:refused`, `${keyPrefix}servers`,
          ].sort());
          assert.deepEqual(await client.zRange(`${keyPrefix}servers`, 0, -1), [S]);
        }
      });

      test('an unregister waits for the register attempt in flight, its steps included (a slow network)', async () => {
        for (const layout of ['keys', 'conns']) {
          const { proxy, rec } = recording(client);
          const keyPrefix = `w${RESP}:${layout}:`;
          const S = 'gw-wait#1';
          const s = new ConnectionServer(proxy, { serverId: S, layout, keyPrefix, ttlMs: 120_000 });
          await s.start();
          const entry = layout === 'conns' ? ['gina', 'phone'] : ['gina'];
          // The forward write of the register takes 400 ms on the network.
          rec.hook = async (words) => {
            if (words[0] === 'SET' || words[0] === 'HSET') await sleep(400);
          };
          rec.log = [];
          const registered = s.register(...entry);
          await sleep(50);
          const unregistered = s.unregister(...entry);
          await registered;
          assert.equal(await unregistered, true, 'the unregister deleted what the register wrote');
          rec.hook = undefined;
          const script = layout === 'conns' ? 'register_conn' : 'register';
          const write = layout === 'conns' ? `HSET ${keyPrefix}user:{gina}:conns` : `SET ${keyPrefix}user:gina`;
          assert.deepEqual(rec.log, [
            `EXISTS ${keyPrefix}server:{${S}}:fenced`, write, `EVALSHA ${script} 3`, 'EVALSHA release 1', `EVALSHA un${script} 3`,
          ]);
          assert.deepEqual(await keysEverywhere(cluster, keyPrefix), [`${keyPrefix}server:{${S}}:alive`, `${keyPrefix}servers`]);
          await s.close();
          assert.deepEqual(await keysEverywhere(cluster, keyPrefix), []);
        }
      });

      test('a fence that expires between its read and the member step: the registration is made whole', async () => {
        const { proxy, rec } = recording(client);
        const keyPrefix = `x${RESP}:`;
        const S = 'gw-back#1';
        const F = `${keyPrefix}server:{${S}}:fenced`;
        const s = new ConnectionServer(proxy, { serverId: S, keyPrefix, ttlMs: 120_000 });
        await s.start();
        await s.register('warm'); // the scripts loaded: one EVALSHA per step below
        await client.hSet(F, 'fenced_at_ms', '1');
        // The fence goes (as when its TTL runs out) right before the member step goes out.
        rec.hook = async (words) => {
          if (words[0] === 'EVALSHA') {
            rec.hook = undefined;
            await client.del(F);
          }
        };
        rec.log = [];
        await s.register('grace');
        assert.deepEqual(rec.log, [`EXISTS ${F}`, 'EVALSHA register 3', `SET ${keyPrefix}user:grace`, 'EVALSHA register 3']);
        assert.equal(await client.get(`${keyPrefix}user:grace`), S, 'registered without its forward entry');
        assert.equal(await client.sIsMember(`${keyPrefix}server:{${S}}:users`, 'grace'), 1);
        await s.close();
      });

      test('a server already fenced writes no forward entry (a user moved to a live server keeps it)', async () => {
        const { proxy, rec } = recording(client);
        const keyPrefix = `z${RESP}:`;
        const F = `${keyPrefix}server:{gw-zombie#1}:fenced`;
        const zombie = new ConnectionServer(proxy, { serverId: 'gw-zombie#1', keyPrefix, ttlMs: 120_000 });
        const live = new ConnectionServer(client, { serverId: 'gw-live#1', keyPrefix });
        await zombie.start();
        await live.start();
        await client.hSet(F, 'fenced_at_ms', '1');
        await live.register('frank');
        rec.log = [];
        await assert.rejects(zombie.register('frank'), FencedError);
        assert.deepEqual(rec.log, [`EXISTS ${F}`, 'EVALSHA register 3']);
        assert.equal(await client.get(`${keyPrefix}user:frank`), 'gw-live#1');
        assert.equal(await new Router(client, { keyPrefix }).route('frank'), 'gw-live#1');
        await live.close();
        await zombie.close();
      });
    });
  }

  test('a plain client given a cluster node: an error that says to use a cluster client', async () => {
    const plain = await nodeClient(cluster.nodes[0].url);
    assert.equal(topologyOf(plain), 'node');
    const router = new Router(plain, { keyPrefix: 'plain:' });
    for (let i = 0; i < 6; i++) {
      // Keys on this node (no-cluster) and on the others (MOVED) alike.
      await assert.rejects(router.route(`user-${i}`), /route\.lua: this Redis is a cluster .*createCluster/);
    }
    const s = new ConnectionServer(plain, { serverId: 'gw-plain#1', keyPrefix: 'plain:' });
    await assert.rejects(s.start(), /heartbeat\.lua: this Redis is a cluster .*createCluster/);
  });

  test('the fence reaches a heartbeating server on a cluster, from the real worker', async (t) => {
    const client = await clusterClient(cluster, 3);
    const keyPrefix = 'cf:';
    const options = { url: cluster.url, layout: 'keys', keyPrefix, cluster: true };
    await startWorker(options, client);
    let fencedAt;
    const fenced = new Promise((resolve) => {
      fencedAt = resolve;
    });
    const s = new ConnectionServer(client, {
      serverId: ConnectionServer.newServerId('gw-cf'), keyPrefix, onFenced: () => fencedAt(Date.now()),
    });
    await s.start();
    const users = Array.from({ length: 200 }, (_, i) => `u${i}`);
    await Promise.all(users.map((u) => s.register(u)));
    const router = new Router(client, { keyPrefix });
    assert.equal(await router.route('u7'), s.serverId);
    await sleep(Math.random() * s.heartbeatIntervalMs); // any phase of the heartbeat
    const emittedAt = Date.now();
    await emitServerDead(s.serverId, options);
    const at = await fenced;
    t.diagnostic(`cluster: emit -> onFenced ${at - emittedAt} ms (interval ${s.heartbeatIntervalMs} ms)`);
    assert.ok(at - emittedAt < s.heartbeatIntervalMs + 10_000);
    assert.equal(await router.route('u7'), null);
    await waitFor('the cleanup', async () => (await router.routeMany(users)).every((o) => o === null) &&
      (await keysEverywhere(cluster, `${keyPrefix}user:`)).length === 0, 30_000, 200);
    await s.close();
  });
});
