// The processes of the scenario: a private redis-server, the janitor's binaries, and the
// Node processes (forked, with an IPC channel). Everything started here is remembered, and
// `stopAll` ends those processes (by their own pid), whatever happened.
import { spawn, fork } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { createClient } from 'redis';
import { freePort, sleep, waitUntil } from './util.js';

export const HERE = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
export const REPO = path.resolve(HERE, '../..');
export const JANITOR_BIN = process.env.REGISTRY_JANITOR_BIN ?? path.join(REPO, 'target/debug/registry-janitor');

const started = new Set();

function remember(child) {
  started.add(child);
  child.on('exit', () => started.delete(child));
  return child;
}

export function stopAll() {
  for (const child of started) {
    try {
      child.kill('SIGKILL'); // a frozen (SIGSTOP) process dies of it too
    } catch {
      // already gone
    }
  }
  started.clear();
}

/** A child's exit, as a promise of {code, signal}. */
export function exited(child) {
  if (child.exitCode !== null || child.signalCode !== null) return Promise.resolve({ code: child.exitCode, signal: child.signalCode });
  return new Promise((resolve) => child.once('exit', (code, signal) => resolve({ code, signal })));
}

/** redis-server on a free port (never 6379, never a fixed one), in `dir`, no persistence,
 * with expiry notifications on (the reconciler's expiry hints). */
export async function startRedis(dir) {
  for (let attempt = 1; ; attempt++) {
    const port = await freePort();
    const logfile = path.join(dir, `redis-${port}.log`);
    const child = remember(
      spawn(
        'redis-server',
        ['--port', String(port), '--bind', '127.0.0.1', '--dir', dir, '--save', '', '--appendonly', 'no', '--notify-keyspace-events', 'Ex', '--logfile', logfile],
        { stdio: 'ignore' },
      ),
    );
    const url = `redis://127.0.0.1:${port}`;
    const client = createClient({ url, socket: { reconnectStrategy: false } });
    client.on('error', () => {});
    try {
      await waitUntil(
        'redis-server to answer',
        async () => {
          if (child.exitCode !== null) throw new Error(`redis-server exited (${child.exitCode}); see ${logfile}`);
          try {
            if (!client.isOpen) await client.connect();
            return (await client.ping()) === 'PONG';
          } catch {
            return false;
          }
        },
        { timeoutMs: 10_000 },
      );
      await client.close();
      return { port, url, child, logfile };
    } catch (err) {
      child.kill('SIGKILL');
      if (attempt >= 3) throw err;
    }
  }
}

/** `registry-janitor <command>` with settings from the environment, its log in `dir`. */
export function startJanitor(command, { dir, env }) {
  if (!fs.existsSync(JANITOR_BIN)) {
    throw new Error(`no janitor binary at ${JANITOR_BIN}: build it with \`cargo build -p registry-janitor\` at the repository's root, or set REGISTRY_JANITOR_BIN`);
  }
  const log = fs.openSync(path.join(dir, `janitor-${command}.log`), 'a');
  const child = remember(spawn(JANITOR_BIN, [command], { env: { ...process.env, ...env }, stdio: ['ignore', log, log] }));
  fs.closeSync(log);
  return child;
}

/** A Node process of this example, forked with IPC; its stderr into `dir/<tag>.log`. */
export function startNode(script, argv, { dir, tag }) {
  const log = fs.openSync(path.join(dir, `${tag}.log`), 'a');
  const child = remember(fork(path.join(HERE, script), argv, { stdio: ['ignore', log, log, 'ipc'], cwd: HERE }));
  fs.closeSync(log);
  child.inbox = [];
  child.waiters = [];
  child.on('message', (m) => {
    const w = child.waiters.find((x) => x.match(m));
    if (w) {
      child.waiters.splice(child.waiters.indexOf(w), 1);
      w.resolve(m);
    } else child.inbox.push(m);
  });
  child.on('error', () => {});
  return child;
}

/** The next message of `child` for which `match` is true (already received ones first). */
export function nextMessage(child, match, { timeoutMs = 60_000, what = 'a message' } = {}) {
  const i = child.inbox.findIndex(match);
  if (i >= 0) return Promise.resolve(child.inbox.splice(i, 1)[0]);
  return new Promise((resolve, reject) => {
    const timer = setTimeout(() => {
      child.waiters.splice(child.waiters.indexOf(w), 1);
      reject(new Error(`timed out after ${timeoutMs} ms waiting for ${what}`));
    }, timeoutMs);
    const w = {
      match,
      resolve: (m) => {
        clearTimeout(timer);
        resolve(m);
      },
    };
    child.waiters.push(w);
  });
}

/** Asks and waits for the answer of type `answer`. */
export function ask(child, message, answer, opts = {}) {
  const p = nextMessage(child, (m) => m?.type === answer, { what: answer, ...opts });
  child.send(message);
  return p;
}

export { sleep };
