// register / route / unregister in each layout on one node, under RESP2 and RESP3.
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { ConnectionServer, Router } from '../dist/index.js';
import { cleanup, nodeClient, startRedis } from './harness.mjs';

let redis;
before(async () => {
  redis = await startRedis();
});
after(cleanup);

/** Keys under `prefix`, sorted. */
async function keysUnder(client, prefix) {
  return (await client.keys(`${prefix}*`)).sort();
}

async function fence(client, prefix, serverId) {
  await client.hSet(`${prefix}server:{${serverId}}:fenced`, 'fenced_at_ms', String(Date.now()));
}

for (const RESP of [2, 3]) {
  describe(`RESP${RESP}`, () => {
    let client;
    before(async () => {
      client = await nodeClient(redis.url, RESP);
    });

    for (const layout of ['hash', 'keys']) {
      test(`layout ${layout}: register, route, a move, unregister, close`, async () => {
        const prefix = `r${RESP}:${layout}:`;
        const opts = { layout, keyPrefix: prefix };
        const s1 = new ConnectionServer(client, { serverId: 'gw-1#1', ...opts });
        const s2 = new ConnectionServer(client, { serverId: 'gw-2#1', ...opts });
        const router = new Router(client, opts);
        await s1.start();
        await s2.start();
        assert.equal(s1.fenced, false);
        assert.ok((await client.pTTL(`${prefix}server:{gw-1#1}:alive`)) > 0);
        assert.ok((await client.zScore(`${prefix}servers`, 'gw-1#1')) > 0);

        await s1.register('alice');
        await s1.register('bob');
        await s1.register(Buffer.from('carol'));
        assert.equal(await router.route('alice'), 'gw-1#1');
        assert.deepEqual(await router.routeMany(['alice', 'bob', 'nobody', 'carol']), ['gw-1#1', 'gw-1#1', null, 'gw-1#1']);
        if (layout === 'hash') assert.equal(await client.hGet(`${prefix}registry`, 'alice'), 'gw-1#1');
        else assert.equal(await client.get(`${prefix}user:alice`), 'gw-1#1');
        assert.deepEqual((await client.sMembers(`${prefix}server:{gw-1#1}:users`)).sort(), ['alice', 'bob', 'carol']);

        // bob reconnects on gw-2 before gw-1 sees his old socket close.
        await s2.register('bob');
        assert.equal(await router.route('bob'), 'gw-2#1');
        assert.equal(await s1.unregister('bob'), false, "gw-1's unregister leaves gw-2's entry");
        assert.equal(await router.route('bob'), 'gw-2#1');
        assert.equal(await s1.unregister('alice'), true);
        assert.equal(await router.route('alice'), null);
        assert.equal(await s1.unregister('alice'), false);

        // An owner that is fenced, or past its liveness, is never returned.
        await client.del(`${prefix}server:{gw-2#1}:alive`);
        assert.equal(await router.route('bob'), null, 'liveness expired');
        await s2.close();
        const s3 = new ConnectionServer(client, { serverId: 'gw-3#1', ...opts });
        await s3.start();
        await s3.register('dave');
        assert.equal(await router.route('dave'), 'gw-3#1');
        await fence(client, prefix, 'gw-3#1');
        assert.equal(await router.route('dave'), null, 'fenced');
        assert.deepEqual(await router.routeMany(['dave', 'carol']), [null, 'gw-1#1']);
        await client.del(`${prefix}server:{gw-3#1}:fenced`);
        await s3.close();

        // close(): what gw-1 registered and did not unregister (carol) goes, then its liveness.
        await s1.close();
        assert.equal(await router.route('carol'), null);
        assert.deepEqual(await keysUnder(client, prefix), []);
        await assert.rejects(s1.register('erin'), /closed/);
        assert.equal(await s1.unregister('erin'), false, 'after close(), unregister does nothing');
      });
    }

    test('layout conns: several connections of one user on three servers', async () => {
      const prefix = `r${RESP}:conns:`;
      const opts = { layout: 'conns', keyPrefix: prefix };
      const [a, b, c] = ['gw-a#1', 'gw-b#1', 'gw-c#1'].map((serverId) => new ConnectionServer(client, { serverId, ...opts }));
      const router = new Router(client, opts);
      for (const s of [a, b, c]) await s.start();

      await c.register('alice', 'laptop');
      await a.register('alice', 'phone');
      await b.register('alice', 'tab-1');
      await b.register('alice', 'tab-2');
      await b.register('bob', 'phone');
      assert.deepEqual(await router.routeUser('alice'), ['gw-a#1', 'gw-b#1', 'gw-c#1'], 'distinct, sorted');
      assert.deepEqual(await router.routeUsers(['alice', 'bob', 'nobody']), [['gw-a#1', 'gw-b#1', 'gw-c#1'], ['gw-b#1'], []]);
      assert.deepEqual({ ...(await client.hGetAll(`${prefix}user:{alice}:conns`)) }, {
        laptop: 'gw-c#1', phone: 'gw-a#1', 'tab-1': 'gw-b#1', 'tab-2': 'gw-b#1',
      });
      assert.deepEqual((await client.sMembers(`${prefix}server:{gw-b#1}:users`)).sort(), ['phone bob', 'tab-1 alice', 'tab-2 alice']);

      await fence(client, prefix, 'gw-c#1');
      assert.deepEqual(await router.routeUser('alice'), ['gw-a#1', 'gw-b#1'], 'a fenced server is not returned');
      await client.del(`${prefix}server:{gw-a#1}:alive`);
      assert.deepEqual(await router.routeUser('alice'), ['gw-b#1'], 'nor one past its liveness');

      // tab-1 moves to gw-a: gw-b's unregister of it leaves the field.
      await a.register('alice', 'tab-1');
      assert.equal(await b.unregister('alice', 'tab-1'), false);
      assert.equal(await client.hGet(`${prefix}user:{alice}:conns`, 'tab-1'), 'gw-a#1');
      assert.equal(await b.unregister('alice', 'tab-2'), true);
      assert.deepEqual(await router.routeUser('alice'), [], 'gw-a past its liveness, gw-c fenced');

      await client.del(`${prefix}server:{gw-c#1}:fenced`);
      for (const s of [a, b, c]) await s.close();
      assert.deepEqual(await keysUnder(client, prefix), [], 'close() left nothing');
      assert.deepEqual(await router.routeUsers(['alice', 'bob']), [[], []]);
    });

    test('the layout decides which lookups a Router takes', async () => {
      await assert.rejects(new Router(client, { layout: 'conns' }).route('alice'), /routeUser/);
      await assert.rejects(new Router(client, { layout: 'keys' }).routeUser('alice'), /route/);
      assert.equal(new Router(client).layout, 'keys');
    });

    test('NOSCRIPT: the scripts are loaded again after SCRIPT FLUSH', async () => {
      const prefix = `r${RESP}:flush:`;
      const s = new ConnectionServer(client, { serverId: 'gw-f#1', keyPrefix: prefix, ttlMs: 900 });
      const router = new Router(client, { keyPrefix: prefix });
      await client.scriptFlush();
      await s.start();
      await client.scriptFlush();
      await s.register('alice');
      await client.scriptFlush();
      assert.equal(await router.route('alice'), 'gw-f#1');
      await client.scriptFlush();
      await new Promise((resolve) => setTimeout(resolve, 800)); // a timer heartbeat after a flush
      assert.equal(await router.route('alice'), 'gw-f#1', 'the heartbeat kept the liveness');
      await client.scriptFlush();
      assert.equal(await s.unregister('alice'), true);
      await s.close();
    });
  });
}

test('route uses EVALSHA_RO, and EVALSHA for a user the ACL denies EVALSHA_RO', async () => {
  const admin = await nodeClient(redis.url);
  await admin.sendCommand(['ACL', 'SETUSER', 'router', 'on', '>pw', '~*', '&*', '+@all', '-evalsha_ro']);
  await admin.configResetStat();
  const prefix = 'acl:';
  const s = new ConnectionServer(admin, { serverId: 'gw-acl#1', keyPrefix: prefix });
  await s.start();
  await s.register('alice');
  await s.register('bob', undefined);

  assert.equal(await new Router(admin, { keyPrefix: prefix }).route('alice'), 'gw-acl#1');
  const stats = async () => {
    const line = (await admin.info('commandstats')).split('\r\n').find((l) => l.startsWith('cmdstat_evalsha_ro:'));
    return Object.fromEntries(line.slice(line.indexOf(':') + 1).split(',').map((kv) => kv.split('=')).map(([k, v]) => [k, Number(v)]));
  };
  const before = await stats();
  assert.ok(before.calls - before.failed_calls >= 1, 'route ran as EVALSHA_RO');
  assert.equal(before.rejected_calls, 0);

  const limited = await nodeClient(redis.url.replace('redis://', 'redis://router:pw@'));
  const router = new Router(limited, { keyPrefix: prefix });
  assert.equal(await router.route('alice'), 'gw-acl#1');
  assert.equal(await router.route('bob'), 'gw-acl#1');
  assert.deepEqual(await router.routeMany(['alice', 'bob', 'nobody']), ['gw-acl#1', 'gw-acl#1', null]);
  const after = await stats();
  assert.equal(after.rejected_calls, 1, 'refused once, then not asked again');
  assert.equal(after.calls, before.calls);
  await s.close();
});
