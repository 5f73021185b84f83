// route never returns a fenced owner during a long cleanup: 50,000 users of S, a worker with
// a small chunk size, users of S routed continuously while it runs.
import assert from 'node:assert/strict';
import { after, test } from 'node:test';

import { ConnectionServer, Router } from '../dist/index.js';
import { cleanup, emitServerDead, nodeClient, startRedis, startWorker, waitFor } from './harness.mjs';

after(cleanup);

const USERS = 50_000;
const MOVED = 500; // users of S who reconnected on T: they keep their entry

test('route never returns a fenced owner while its 50,000 entries are cleaned', async (t) => {
  const redis = await startRedis();
  const client = await nodeClient(redis.url, 3);
  const keyPrefix = 'long:';
  const options = { url: redis.url, layout: 'keys', keyPrefix, chunkSize: 20 };
  // S's liveness outlives the test: only the fence keeps route from returning it.
  const s = new ConnectionServer(client, { serverId: 'gw-s#1', keyPrefix, ttlMs: 120_000 });
  const live = new ConnectionServer(client, { serverId: 'gw-t#1', keyPrefix });
  await s.start();
  await live.start();
  const users = Array.from({ length: USERS }, (_, i) => `user-${i}`);
  const began = Date.now();
  for (let i = 0; i < USERS; i += 2000) await Promise.all(users.slice(i, i + 2000).map((u) => s.register(u)));
  t.diagnostic(`registered ${USERS} users in ${Date.now() - began} ms`);
  for (const u of users.slice(0, MOVED)) await live.register(u);

  const router = new Router(client, { keyPrefix });
  assert.deepEqual(await router.routeMany(['user-0', `user-${USERS - 1}`]), ['gw-t#1', 'gw-s#1']);
  await startWorker(options, client);
  await emitServerDead(s.serverId, options);
  await waitFor('the fence', async () => (await client.exists(`${keyPrefix}server:{gw-s#1}:fenced`)) === 1, 20_000, 2);
  const left = async () => (await client.sCard(`${keyPrefix}server:{gw-s#1}:users`)) + (await client.sCard(`${keyPrefix}server:{gw-s#1}:walking`));
  const leftAtStart = await left();

  const cleaned = async () => {
    const entries = await client.xRange(`${keyPrefix}registry:evictions`, '-', '+');
    return entries.some((e) => e.message.type === 'server.cleaned');
  };
  let lookups = 0;
  let routedToS = 0;
  let routedToT = 0;
  let rounds = 0;
  const loopBegan = Date.now();
  for (;;) {
    const done = await cleaned();
    const batch = Array.from({ length: 500 }, () => users[Math.floor(Math.random() * USERS)]);
    const owners = await router.routeMany(batch);
    lookups += owners.length;
    rounds += 1;
    owners.forEach((o, i) => {
      if (o === 'gw-s#1') routedToS += 1;
      if (o === 'gw-t#1') routedToT += 1;
      if (o === 'gw-t#1') assert.ok(Number(batch[i].slice(5)) < MOVED);
    });
    if (done) break;
    if (Date.now() - loopBegan > 120_000) assert.fail('the cleanup did not finish within 120 s');
  }
  t.diagnostic(
    `cleanup: ${leftAtStart} members left when the fence was seen; ${lookups} lookups in ${rounds} rounds ` +
      `during ${Date.now() - loopBegan} ms; routed to the fenced server: ${routedToS}; to the live one: ${routedToT}`,
  );
  assert.ok(leftAtStart > 0, 'the lookups ran while the cleanup did');
  assert.equal(routedToS, 0, 'route never returned the fenced owner');
  assert.ok(rounds >= 2);

  // Everything of S is gone but the users who had moved to T.
  assert.deepEqual(await router.routeMany(users.slice(MOVED - 2, MOVED + 2)), ['gw-t#1', 'gw-t#1', null, null]);
  const remaining = [];
  for await (const keys of client.scanIterator({ MATCH: `${keyPrefix}user:*`, COUNT: 5000 })) remaining.push(...keys);
  assert.equal(remaining.length, MOVED);
  await live.close();
  await s.close();
  const after = [];
  for await (const keys of client.scanIterator({ MATCH: `${keyPrefix}user:*`, COUNT: 5000 })) after.push(...keys);
  assert.equal(after.length, 0, "T's close() unregistered its users");
});
