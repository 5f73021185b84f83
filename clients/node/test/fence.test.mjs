// The fence, with the real janitor worker: a heartbeating server learns it within about one
// heartbeat interval; a zombie's registrations are refused and nothing is written.
// And Redis going away: retries, onHeartbeatLost / onHeartbeatRestored.
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { ConnectionServer, FencedError, RedisTimeoutError, Router } from '../dist/index.js';
import {
  cleanup, emitServerDead, janitorBinary, nodeClient, sleep, startRedis, startWorker, waitFor,
} from './harness.mjs';

after(cleanup);

/** `client` whose sendCommand calls are counted (to show that a call touched no Redis). */
function counting(client) {
  const counter = { commands: 0 };
  const proxy = new Proxy(client, {
    get(target, prop) {
      const value = Reflect.get(target, prop, target);
      if (prop === 'sendCommand') {
        return (...args) => {
          counter.commands += 1;
          return value.apply(target, args);
        };
      }
      return typeof value === 'function' ? value.bind(target) : value;
    },
  });
  return { proxy, counter };
}

/** A promise of the first onFenced call, and a count of every call. */
function fenceWatch() {
  const watch = { calls: 0, at: undefined, error: undefined };
  watch.fenced = new Promise((resolve) => {
    watch.onFenced = (err) => {
      watch.calls += 1;
      if (watch.calls === 1) {
        watch.at = Date.now();
        watch.error = err;
        resolve(err);
      }
    };
  });
  return watch;
}

describe('with the janitor worker', () => {
  let redis;
  before(async () => {
    janitorBinary(); // fails with how to build it, if it is missing
    redis = await startRedis();
  });

  for (const RESP of [2, 3]) {
    test(`RESP${RESP}: the fence reaches a heartbeating server within about one interval`, async (t) => {
      const client = await nodeClient(redis.url, RESP);
      const keyPrefix = `f${RESP}:`;
      const options = { url: redis.url, layout: 'keys', keyPrefix };
      await startWorker(options, client);
      const watch = fenceWatch();
      const ttlMs = 3000;
      const s = new ConnectionServer(client, {
        serverId: ConnectionServer.newServerId('gw-fence'), keyPrefix, ttlMs, onFenced: watch.onFenced,
      });
      await s.start();
      for (let i = 0; i < 20; i++) await s.register(`u${i}`);
      const router = new Router(client, { keyPrefix });
      assert.equal(await router.route('u0'), s.serverId);

      await sleep(Math.random() * s.heartbeatIntervalMs); // any phase of the heartbeat
      const emittedAt = Date.now();
      await emitServerDead(s.serverId, options);
      const err = await watch.fenced;
      const tookMs = watch.at - emittedAt;
      const fencedAtMs = Number(await client.hGet(`${keyPrefix}server:{${s.serverId}}:fenced`, 'fenced_at_ms'));
      t.diagnostic(`RESP${RESP}: emit -> onFenced ${tookMs} ms; fence written -> onFenced ${watch.at - fencedAtMs} ms (interval ${s.heartbeatIntervalMs} ms)`);
      assert.ok(err instanceof FencedError);
      assert.equal(err.code, 'FENCED');
      assert.equal(err.serverId, s.serverId);
      assert.match(err.message, /^FENCED server .* was declared dead/);
      assert.equal(s.fenced, true);
      // One interval, plus the worker's pickup, plus a generous slack for a busy machine.
      assert.ok(tookMs < s.heartbeatIntervalMs + 10_000, `onFenced after ${tookMs} ms`);

      // The timer stopped: the refused heartbeat was the last one.
      const refused = `${keyPrefix}server:{${s.serverId}}:refused`;
      const heartbeats = await client.hGet(refused, 'heartbeat');
      await sleep(2.5 * s.heartbeatIntervalMs);
      assert.equal(await client.hGet(refused, 'heartbeat'), heartbeats);
      assert.equal(heartbeats, '1');
      await assert.rejects(s.register('late'), FencedError);
      assert.equal(watch.calls, 1, 'onFenced is called once');

      // The janitor cleans up after it; route never returned it meanwhile.
      assert.equal(await router.route('u0'), null);
      await waitFor('the cleanup', async () => (await client.exists(`${keyPrefix}user:u19`)) === 0);
      await s.close(); // a fenced server touches nothing
    });
  }

  test("a zombie's registrations are refused, and nothing is written", async () => {
    const client = await nodeClient(redis.url);
    const keyPrefix = 'zombie:';
    const options = { url: redis.url, layout: 'conns', keyPrefix };
    await startWorker(options, client);
    const { proxy, counter } = counting(client);
    const watch = fenceWatch();
    // A heartbeat too slow to learn the verdict before the next registration: a zombie.
    const zombie = new ConnectionServer(proxy, {
      serverId: 'gw-zombie#1', layout: 'conns', keyPrefix, ttlMs: 120_000, onFenced: watch.onFenced,
    });
    await zombie.start();
    await zombie.register('alice', 'phone');
    await emitServerDead(zombie.serverId, options);
    const fence = `${keyPrefix}server:{gw-zombie#1}:fenced`;
    await waitFor('the fence', async () => (await client.exists(fence)) === 1);
    await waitFor('the cleanup', async () => (await client.exists(`${keyPrefix}user:{alice}:conns`)) === 0);
    const users = `${keyPrefix}server:{gw-zombie#1}:users`;
    const keysBefore = (await client.keys(`${keyPrefix}*`)).sort();

    await assert.rejects(zombie.register('bob', 'laptop'), (err) => err instanceof FencedError && err.serverId === 'gw-zombie#1');
    assert.equal(zombie.fenced, true);
    assert.equal(watch.calls, 1);
    assert.equal(await client.exists(`${keyPrefix}user:{bob}:conns`), 0, 'no forward entry');
    assert.equal(await client.exists(users), 0, 'no member');
    assert.equal(await client.hGet(`${keyPrefix}server:{gw-zombie#1}:refused`, 'register'), '1', 'the refusal is noted');
    assert.deepEqual((await client.keys(`${keyPrefix}*`)).sort(), [...new Set([...keysBefore, `${keyPrefix}server:{gw-zombie#1}:refused`])].sort());

    // From now on, refused at once, without a command sent.
    const sent = counter.commands;
    await assert.rejects(zombie.register('carol', 'tab'), FencedError);
    await assert.rejects(zombie.unregister('alice', 'phone'), FencedError);
    await assert.rejects(zombie.start(), /start\(\) was called already/);
    assert.equal(counter.commands, sent, 'no command after the fence was learned');
    assert.equal(watch.calls, 1, 'onFenced once');

    // A new incarnation of an id already fenced: start() is refused.
    const again = fenceWatch();
    const restart = new ConnectionServer(client, { serverId: 'gw-zombie#1', layout: 'conns', keyPrefix, onFenced: again.onFenced });
    await assert.rejects(restart.start(), FencedError);
    assert.equal(again.calls, 1);
    await zombie.close();
    await restart.close();
  });
});

describe('when Redis goes away', () => {
  test('onHeartbeatLost once per stretch, onHeartbeatRestored, and retried registrations', async (t) => {
    const redis = await startRedis();
    const client = await nodeClient(redis.url);
    const events = [];
    const s = new ConnectionServer(client, {
      serverId: 'gw-pause#1',
      ttlMs: 1500,
      onHeartbeatLost: (info) => events.push({ lost: info, at: Date.now() }),
      onHeartbeatRestored: (info) => events.push({ restored: info, at: Date.now() }),
      onFenced: () => events.push({ fenced: true }),
    });
    await s.start();
    await s.register('before');

    const pausedAt = Date.now();
    let resumedAt;
    redis.pause();
    try {
      await waitFor('onHeartbeatLost', () => events.length > 0, 15_000);
      const pending = s.register('during'); // waits for Redis, within the retry budget
      const quick = new ConnectionServer(client, { serverId: 'gw-quick#1', retry: { timeoutMs: 800 } });
      const gaveUp = Date.now();
      await assert.rejects(quick.start(), RedisTimeoutError, 'a call gives up after its retry budget');
      t.diagnostic(`a call with retry.timeoutMs 800 gave up after ${Date.now() - gaveUp} ms`);
      await sleep(1000);
      resumedAt = Date.now();
      redis.resume();
      await pending;
    } finally {
      redis.resume();
    }
    await waitFor('onHeartbeatRestored', () => events.some((e) => e.restored), 15_000);
    const [lost, restored, ...rest] = events;
    t.diagnostic(`paused ${resumedAt - pausedAt} ms; lost reported ${lost.at - pausedAt} ms after the pause (ttl 1500 ms); restored ${restored.at - resumedAt} ms after the resume`);
    assert.ok(lost.lost.forMs > 1500, `forMs ${lost.lost.forMs}`);
    assert.ok(lost.lost.sinceMs <= pausedAt);
    assert.ok(lost.lost.error instanceof Error);
    assert.ok(restored.restored.forMs > 1500);
    assert.deepEqual(rest, [], 'one lost and one restored, nothing else');
    const router = new Router(client);
    assert.deepEqual(await router.routeMany(['before', 'during']), ['gw-pause#1', 'gw-pause#1']);
    await s.close();
    // Only what the call that gave up sent before it did (it landed once Redis woke up).
    assert.deepEqual((await client.keys('*')).filter((k) => !k.includes('gw-quick')), ['servers']);
    assert.deepEqual(await client.zRange('servers', 0, -1), ['gw-quick#1']);
  });

  test('close() while Redis is away: rejects, and leaves the liveness to expire for the janitor', async () => {
    const redis = await startRedis();
    const client = await nodeClient(redis.url);
    const s = new ConnectionServer(client, { serverId: 'gw-away#1', ttlMs: 60_000, retry: { timeoutMs: 500 } });
    await s.start();
    for (const u of ['a', 'b', 'c']) await s.register(u);
    redis.pause();
    try {
      await assert.rejects(s.close(), (err) => err instanceof AggregateError && /could not unregister 3 of 3 entries; its liveness is left to expire/.test(err.message));
    } finally {
      redis.resume();
    }
    assert.equal(await client.exists('server:{gw-away#1}:alive'), 1, 'the liveness key was not deleted');
    assert.ok((await client.zScore('servers', 'gw-away#1')) > 0);
    await assert.rejects(s.register('d'), /closed/);
  });

  test('connections killed while registering: every registration lands', async () => {
    const redis = await startRedis();
    const client = await nodeClient(redis.url, 3);
    const admin = await nodeClient(redis.url);
    const s = new ConnectionServer(client, { serverId: 'gw-kill#1', layout: 'hash' });
    await s.start();
    const all = [];
    for (let i = 0; i < 300; i++) {
      all.push(s.register(`u${i}`));
      if (i % 50 === 25) {
        await admin.sendCommand(['CLIENT', 'KILL', 'TYPE', 'normal', 'SKIPME', 'yes']);
        await sleep(5);
      }
    }
    await Promise.all(all);
    assert.equal(await admin.hLen('registry'), 300);
    assert.equal(await admin.sCard('server:{gw-kill#1}:users'), 300);
    await s.close();
    assert.equal(await admin.dbSize(), 0);
  });
});
