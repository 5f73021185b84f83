// Calls of one ConnectionServer on the same entry (a user; layout conns: a user's
// connection) apply in the order they were made, retries included; and close() keeps
// heartbeating while it unregisters.
//
// Redis refuses with BUSY while another client runs a long script (busy-reply-threshold
// 50 ms) until SCRIPT KILL: a call's first attempt fails, and its retry comes 500 to 1000 ms
// later (retry.baseDelayMs 1000), so that the next call of the same entry is made while the
// first one waits to try again. A slow network is a client whose sendCommand waits before
// it forwards a command.
import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';

import { ClosedError, ConnectionServer, Router, scriptShas } from '../dist/index.js';
import { cleanup, nodeClient, sleep, startRedis } from './harness.mjs';

after(cleanup);

const SLOW_RETRY = { baseDelayMs: 1000, maxDelayMs: 2000, timeoutMs: 10_000 };
const BUSY_LOOP =
  'local t = redis.call("TIME") while true do local n = redis.call("TIME") ' +
  'if (n[1] - t[1]) * 1000000 + (n[2] - t[2]) > 5000000 then break end end return 1';

/** `client` whose sendCommand calls pass through `hook(args)` (awaited) first. */
function slowNetwork(client) {
  const net = { hook: undefined };
  const proxy = new Proxy(client, {
    get(target, prop) {
      const value = Reflect.get(target, prop, target);
      if (prop === 'sendCommand') {
        return async (args, options) => {
          await net.hook?.(args.map(String));
          return value.call(target, args, options);
        };
      }
      return typeof value === 'function' ? value.bind(target) : value;
    },
  });
  return { proxy, net };
}

describe('calls of one entry, in order', () => {
  let redis;
  let client;
  let admin;
  before(async () => {
    redis = await startRedis(['--busy-reply-threshold', '50']);
    client = await nodeClient(redis.url);
    admin = await nodeClient(redis.url);
  });

  /** Every other client gets BUSY until the returned stop() (SCRIPT KILL). */
  async function busy() {
    const blocker = await nodeClient(redis.url);
    const running = blocker.sendCommand(['EVAL', BUSY_LOOP, '0']).catch(() => undefined);
    await sleep(150); // past busy-reply-threshold
    return async () => {
      await admin.sendCommand(['SCRIPT', 'KILL']);
      await running;
    };
  }

  const keysOf = async (prefix) => (await admin.keys(`${prefix}*`)).sort();

  for (const layout of ['keys', 'conns']) {
    const entry = layout === 'conns' ? ['alice', 'phone'] : ['alice'];
    const routeAlice = (router) => (layout === 'conns' ? router.routeUser('alice') : router.route('alice'));
    const nobody = layout === 'conns' ? [] : null;

    test(`${layout}: a socket closed while its register retries: nothing of the register lands after the unregister`, async () => {
      const keyPrefix = `late-${layout}:`;
      const s = new ConnectionServer(client, { serverId: 'gw-late#1', layout, keyPrefix, ttlMs: 120_000, retry: SLOW_RETRY });
      await s.start();
      const stop = await busy();
      const registered = s.register(...entry); // BUSY; its retry is 500 to 1000 ms away
      await sleep(100);
      await stop();
      assert.equal(await s.unregister(...entry), false, 'nothing was registered');
      await registered; // superseded: no further attempt
      await sleep(200);
      const router = new Router(client, { layout, keyPrefix });
      assert.deepEqual(await routeAlice(router), nobody, 'the register landed after the unregister');
      assert.deepEqual(await keysOf(keyPrefix), [`${keyPrefix}server:{gw-late#1}:alive`, `${keyPrefix}servers`]);
      await s.close();
      assert.deepEqual(await keysOf(keyPrefix), [], 'close() left nothing');
    });

    test(`${layout}: a reconnect to the same server while the old socket's unregister retries keeps the entry`, async () => {
      const keyPrefix = `same-${layout}:`;
      const s = new ConnectionServer(client, { serverId: 'gw-same#1', layout, keyPrefix, ttlMs: 120_000, retry: SLOW_RETRY });
      await s.start();
      await s.register(...entry);
      const stop = await busy();
      const unregistered = s.unregister(...entry); // the old socket: BUSY, retried 500 to 1000 ms later
      await sleep(100);
      await stop();
      await s.register(...entry); // the new socket, on the same server
      assert.equal(await unregistered, false, 'superseded by the register');
      await sleep(200);
      const router = new Router(client, { layout, keyPrefix });
      assert.deepEqual(await routeAlice(router), layout === 'conns' ? ['gw-same#1'] : 'gw-same#1', 'alice is connected, and has no entry');
      assert.equal(await admin.sCard(`${keyPrefix}server:{gw-same#1}:users`), 1);
      await s.close();
      assert.deepEqual(await keysOf(keyPrefix), []);
    });

    test(`${layout}: an unregister waits for the register attempt in flight (a slow network)`, async () => {
      const keyPrefix = `flight-${layout}:`;
      const { proxy, net } = slowNetwork(client);
      const s = new ConnectionServer(proxy, { serverId: 'gw-flight#1', layout, keyPrefix, ttlMs: 120_000 });
      await s.start();
      const sha = scriptShas[layout === 'conns' ? 'register_conn' : 'register'];
      const sent = [];
      net.hook = async (args) => {
        if (args[0] === 'EVALSHA') sent.push(args[1] === sha ? 'register' : 'unregister');
        if (args[0] === 'EVALSHA' && args[1] === sha) await sleep(400);
      };
      const registered = s.register(...entry);
      await sleep(50); // its command is on its way
      const unregistered = s.unregister(...entry);
      await registered;
      assert.equal(await unregistered, true, 'the unregister deleted what the register wrote');
      net.hook = undefined;
      assert.deepEqual(sent, ['register', 'unregister']);
      assert.deepEqual(await routeAlice(new Router(client, { layout, keyPrefix })), nobody);
      assert.deepEqual(await keysOf(keyPrefix), [`${keyPrefix}server:{gw-flight#1}:alive`, `${keyPrefix}servers`]);
      await s.close();
      assert.deepEqual(await keysOf(keyPrefix), []);
    });
  }

  test('close() stops a register still retrying (ClosedError), and unregisters its entry', async () => {
    const keyPrefix = 'closed:';
    const s = new ConnectionServer(client, { serverId: 'gw-closed#1', keyPrefix, ttlMs: 120_000, retry: SLOW_RETRY });
    await s.start();
    await s.register('bob');
    const stop = await busy();
    const registered = s.register('alice'); // BUSY; its retry is 500 to 1000 ms away
    const outcome = registered.then(() => 'resolved', (err) => err);
    await sleep(100);
    await stop();
    await s.close();
    const err = await outcome;
    assert.ok(err instanceof ClosedError, `register: ${err}`);
    assert.deepEqual(await keysOf(keyPrefix), [], 'close() left nothing');
  });

  test('close() keeps heartbeating while it unregisters, and stops before it removes the liveness', async () => {
    const keyPrefix = 'closing:';
    const { proxy, net } = slowNetwork(client);
    const ttlMs = 1000;
    const s = new ConnectionServer(proxy, { serverId: 'gw-closing#1', keyPrefix, ttlMs });
    await s.start();
    await s.register('a');
    await s.register('b');
    const alive = `${keyPrefix}server:{gw-closing#1}:alive`;
    const seen = [];
    // Each unregister takes 2.5 TTLs on the network: close() lasts past the TTL.
    net.hook = async (args) => {
      if (args[0] === 'EVALSHA' && args[1] === scriptShas.unregister) {
        await sleep(2.5 * ttlMs);
        seen.push(await admin.exists(alive));
      }
    };
    await s.close();
    net.hook = undefined;
    assert.deepEqual(seen, [1, 1], 'the liveness key expired while close() unregistered');
    assert.equal(await admin.exists(alive), 0);
    assert.equal(await admin.zScore(`${keyPrefix}servers`, 'gw-closing#1'), null);
    await sleep(3 * s.heartbeatIntervalMs);
    assert.deepEqual(await keysOf(keyPrefix), [], 'no heartbeat after close()');
  });
});
