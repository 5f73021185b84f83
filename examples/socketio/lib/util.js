// Small helpers shared by the processes of the scenario.
import net from 'node:net';

export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** A TCP port nobody listens on right now (the kernel picks it): never a fixed port. */
export function freePort() {
  return new Promise((resolve, reject) => {
    const srv = net.createServer();
    srv.unref();
    srv.on('error', reject);
    srv.listen(0, '127.0.0.1', () => {
      const { port } = srv.address();
      srv.close(() => resolve(port));
    });
  });
}

/** Polls `fn` until it returns a truthy value; rejects after `timeoutMs` naming `what`. */
export async function waitUntil(what, fn, { timeoutMs = 30_000, everyMs = 50 } = {}) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await fn();
    if (value) return value;
    if (Date.now() > deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(everyMs);
  }
}

/** Sends IPC messages to the parent when there is one; logs them on stderr otherwise. */
export function report(message) {
  if (process.send && process.connected) process.send(message);
  else process.stderr.write(`${JSON.stringify(message)}\n`);
}

/** Key names, under the deployment's key prefix (docs/specification.md, "Keys and their owners"). */
export function keys(prefix = '') {
  return {
    registry: `${prefix}registry`,
    user: (user) => `${prefix}user:${user}`,
    conns: (user) => `${prefix}user:{${user}}:conns`,
    server: (id, what) => `${prefix}server:{${id}}:${what}`,
    servers: `${prefix}servers`,
    events: `${prefix}registry:events`,
    evictions: `${prefix}registry:evictions`,
    notices: `${prefix}presence:notices`,
    deliver: (id) => `${prefix}deliver:${id}`,
  };
}

/** The fault policy of one client connection (deterministic, so that runs are alike):
 * when its server is killed or frozen, about 1 in 10 never comes back ("gone") and
 * 1 in 10 comes back only after the janitor cleaned the server ("late"). */
export function policyOf(index, device) {
  const r = (index * 7 + device * 3) % 10;
  if (r === 0) return 'gone';
  if (r === 1) return 'late';
  return 'now';
}
