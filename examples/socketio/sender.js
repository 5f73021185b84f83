#!/usr/bin/env node
// The sender: every few ms, a message to a random user, routed through the Router of the
// Node client (`route`, or `routeUser` in layout `conns`) and delivered to the owning
// server(s) on the Redis pub/sub channel `deliver:<server id>`.
//
// Beside each Router call, in the same tick on the same connection (so the two run back to
// back in Redis), a plain read of the forward entry (`GET user:<user>`, `HGET registry`,
// or `HVALS user:{<user>}:conns`): what a router that does not use the protocol's route
// script would have used. Both answers are recorded with the time the call was sent and
// answered; the parent classifies them against the faults (dead or fenced server, before
// or after its verdict) at the end.
//
// Driven by its parent over IPC: `start` {redisUrl, layout, keyPrefix, users, intervalMs},
// `stop` (answers `records`).
import { createClient } from 'redis';
import { Router } from '@registry-janitor/client';
import { keys, report, sleep } from './lib/util.js';

let running = false;
const records = []; // [sentAt, answeredAt, user, router servers[], plain servers[], id]
let seq = 0;
let inFlight = 0;
let errors = 0;
let lastError = null;

async function routeOne(redis, router, K, layout, user) {
  const id = ++seq;
  const sentAt = Date.now();
  let viaRouter;
  let plain;
  if (layout === 'conns') {
    [viaRouter, plain] = await Promise.all([router.routeUser(user), redis.hVals(K.conns(user))]);
    plain = [...new Set(plain)].sort();
  } else {
    const read = layout === 'hash' ? redis.hGet(K.registry, user) : redis.get(K.user(user));
    const [owner, value] = await Promise.all([router.route(user), read]);
    viaRouter = owner ? [owner] : [];
    plain = value ? [value] : [];
  }
  const answeredAt = Date.now();
  records.push([sentAt, answeredAt, user, viaRouter, plain, id]);
  const message = JSON.stringify({ id, user, sentAt });
  await Promise.all(viaRouter.map((server) => redis.publish(K.deliver(server), message)));
}

process.on('message', async (m) => {
  if (m?.type === 'start') {
    const redis = createClient({ url: m.redisUrl });
    redis.on('error', (err) => {
      lastError = err.message;
    });
    await redis.connect();
    const router = new Router(redis, { layout: m.layout, keyPrefix: m.keyPrefix ?? '' });
    const K = keys(m.keyPrefix ?? '');
    running = true;
    report({ type: 'sending' });
    while (running) {
      if (inFlight < 64) {
        const user = m.users[Math.floor(Math.random() * m.users.length)];
        inFlight++;
        routeOne(redis, router, K, m.layout, user)
          .catch((err) => {
            errors++;
            lastError = err.message;
          })
          .finally(() => inFlight--);
      }
      await sleep(m.intervalMs);
    }
    while (inFlight > 0) await sleep(10);
    await redis.close().catch(() => {});
    report({ type: 'records', records, errors, lastError });
  } else if (m?.type === 'stop') {
    running = false;
  }
});
process.on('disconnect', () => process.exit(0));
