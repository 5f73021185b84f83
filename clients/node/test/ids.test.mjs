// Identifiers are refused before anything is written, with an error naming the rule.
import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';

import {
  ConnectionServer, CONNECTION_ID_RULE, InvalidIdError, Router, SERVER_ID_RULE, USER_ID_RULE,
} from '../dist/index.js';
import { cleanup, nodeClient, snapshot, startRedis } from './harness.mjs';

let redis;
let client;
before(async () => {
  redis = await startRedis();
  client = await nodeClient(redis.url);
});
after(cleanup);

function invalid(kind, rule) {
  return (err) => {
    assert.ok(err instanceof InvalidIdError, `an InvalidIdError, got ${err}`);
    assert.equal(err.kind, kind);
    assert.equal(err.rule, rule);
    assert.ok(err.message.startsWith(`${rule}: got `), err.message);
    return true;
  };
}

test('server ids: 1 to 200 bytes of printable ASCII, no whitespace, no braces', () => {
  for (const bad of ['', 'gw 7', 'gw{7}', 'gw}', 'gw\t7', 'gé', 'x'.repeat(201), undefined, 7]) {
    assert.throws(() => new ConnectionServer(client, { serverId: bad }), invalid('server id', SERVER_ID_RULE));
  }
  for (const good of ['g', 'gw-7#1732181000123', 'x'.repeat(200), '!~|']) {
    assert.equal(new ConnectionServer(client, { serverId: good }).serverId, good);
  }
  assert.match(ConnectionServer.newServerId('gw-7'), /^gw-7#\d{13}$/);
  const a = ConnectionServer.newServerId('gw-7#1');
  const b = ConnectionServer.newServerId('gw-7#1');
  assert.notEqual(a, b, 'two incarnations never share an id');
  assert.throws(() => ConnectionServer.newServerId('gw 7'), invalid('server id', SERVER_ID_RULE));
});

test('bad user and connection ids write nothing, in every layout', async () => {
  const before = await snapshot(client);
  const servers = {};
  for (const layout of ['hash', 'keys', 'conns']) {
    servers[layout] = new ConnectionServer(client, { serverId: `gw-${layout}#1`, layout });
    await servers[layout].start();
  }
  const started = await snapshot(client); // the heartbeats' keys only
  assert.ok(started.size > before.size);

  for (const layout of ['hash', 'keys']) {
    const s = servers[layout];
    for (const bad of ['', 'x'.repeat(513), Buffer.alloc(0), Buffer.alloc(513), null, 42]) {
      await assert.rejects(s.register(bad), invalid('user id', USER_ID_RULE));
      await assert.rejects(s.unregister(bad), invalid('user id', USER_ID_RULE));
    }
    // Strings that are not well-formed UTF-16 (a lone surrogate) would be sent as U+FFFD:
    // different ids, one key.
    assert.match(USER_ID_RULE, /well-formed/);
    for (const bad of ['\ud800', 'a\udfff', '\udc00\ud800', `${'x'.repeat(10)}\ud83d`]) {
      await assert.rejects(s.register(bad), invalid('user id', USER_ID_RULE));
      await assert.rejects(s.unregister(bad), invalid('user id', USER_ID_RULE));
      await assert.rejects(new Router(client, { layout }).route(bad), invalid('user id', USER_ID_RULE));
    }
    await assert.rejects(s.register('alice', 'phone'), /for layout conns/);
    const r = new Router(client, { layout });
    await assert.rejects(r.route(''), invalid('user id', USER_ID_RULE));
    await assert.rejects(r.routeMany(['ok', '']), invalid('user id', USER_ID_RULE));
  }
  const s = servers.conns;
  for (const bad of [undefined, '', 'tab 1', 'tab{1}', 'x'.repeat(201), 'ph\u00f6ne']) {
    await assert.rejects(s.register('alice', bad), invalid('connection id', CONNECTION_ID_RULE));
    await assert.rejects(s.unregister('alice', bad), invalid('connection id', CONNECTION_ID_RULE));
  }
  await assert.rejects(s.register('', 'phone'), invalid('user id', USER_ID_RULE));
  await assert.rejects(s.register('\ud800', 'phone'), invalid('user id', USER_ID_RULE));
  await assert.rejects(new Router(client, { layout: 'conns' }).routeUser('\udfff'), invalid('user id', USER_ID_RULE));
  await assert.rejects(new Router(client, { layout: 'conns' }).routeUser(''), invalid('user id', USER_ID_RULE));

  const afterwards = await snapshot(client);
  // The liveness keys are refreshed by the heartbeats (their TTL moves); nothing else.
  for (const key of afterwards.keys()) assert.ok(started.has(key), `key ${key} was written`);
  for (const [key, value] of started) {
    if (!key.endsWith(':alive') && key !== 'servers') assert.equal(afterwards.get(key), value, `key ${key} changed`);
  }
  assert.deepEqual([...afterwards.keys()].sort(), [...started.keys()].sort());
  for (const s of Object.values(servers)) await s.close();
});

test('user ids are any bytes, 1 to 512 of them, in layout conns too', async () => {
  const s = new ConnectionServer(client, { serverId: 'gw-bytes#1', layout: 'conns' });
  await s.start();
  const odd = Buffer.from([0xff, 0x20, 0x7b, 0x7d, 0x00, 0x0a]); // not UTF-8, a space, braces, NUL
  await s.register(odd, 'c1');
  await s.register('x'.repeat(512), 'c1');
  await s.register('\u{1F600}'.repeat(128), 'c1'); // 512 bytes of surrogate pairs: well-formed
  const router = new Router(client, { layout: 'conns' });
  assert.deepEqual(await router.routeUser(odd), ['gw-bytes#1']);
  assert.deepEqual(await router.routeUser(Uint8Array.from(odd)), ['gw-bytes#1'], 'a Uint8Array is the same user');
  assert.deepEqual(await router.routeUser('x'.repeat(512)), ['gw-bytes#1']);
  await s.close();
  assert.deepEqual(await router.routeUser(odd), []);
  assert.equal(await client.dbSize(), 0, 'close() left nothing');
});
