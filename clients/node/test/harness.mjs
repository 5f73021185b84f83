// The test harness: real redis-server processes (a node, a Sentinel setup, a 3-master
// cluster) on free ports, in temporary directories, and the real janitor binary. Every
// process it starts is killed, and every directory removed, by cleanup() (and, should a
// test file die, by the process's exit hook).

import { execFile, spawn } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';

import { createClient, createCluster, createSentinel } from 'redis';

export const REPO = fileURLToPath(new URL('../../../', import.meta.url));
export const PACKAGE = fileURLToPath(new URL('../', import.meta.url));

const run = promisify(execFile);
export const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

const processes = new Set();
const directories = new Set();
const clients = new Set();
const handedOut = new Set();

process.on('exit', () => {
  for (const p of processes) {
    try {
      p.kill('SIGKILL');
    } catch {}
  }
  for (const d of directories) rmSync(d, { recursive: true, force: true });
});

/** Kills every process, closes every client, removes every directory started here. */
export async function cleanup() {
  await Promise.allSettled([...clients].map((c) => c.destroy?.() ?? c.close?.()));
  clients.clear();
  await Promise.allSettled([...processes].map((p) => stopProcess(p)));
  for (const d of directories) rmSync(d, { recursive: true, force: true });
  directories.clear();
}

function stopProcess(p) {
  processes.delete(p);
  if (p.exitCode !== null || p.signalCode !== null) return Promise.resolve();
  return new Promise((resolve) => {
    p.once('exit', resolve);
    try {
      p.kill('SIGCONT');
      p.kill('SIGKILL');
    } catch {
      resolve();
    }
  });
}

export function tempDir(name) {
  const dir = mkdtempSync(path.join(tmpdir(), `rj-node-${name}-`));
  directories.add(dir);
  return dir;
}

/** A port nobody listens on now: bind port 0, read it, close. */
export async function freePort() {
  for (;;) {
    const port = await new Promise((resolve, reject) => {
      const s = net.createServer();
      s.once('error', reject);
      s.listen(0, '127.0.0.1', () => {
        const { port } = s.address();
        s.close(() => resolve(port));
      });
    });
    // Cluster bus ports of our own are picked the same way; never hand one out twice.
    if (!handedOut.has(port)) {
      handedOut.add(port);
      return port;
    }
  }
}

/** Polls `check` until it returns a truthy value, or fails after `timeoutMs`. */
export async function waitFor(what, check, timeoutMs = 20_000, everyMs = 50) {
  const deadline = Date.now() + timeoutMs;
  let last;
  for (;;) {
    try {
      const value = await check();
      if (value) return value;
    } catch (err) {
      last = err;
    }
    if (Date.now() > deadline) {
      throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}${last ? `: ${last.message}` : ''}`);
    }
    await sleep(everyMs);
  }
}

export async function cli(port, ...args) {
  const { stdout } = await run('redis-cli', ['-h', '127.0.0.1', '-p', String(port), ...args.map(String)], {
    timeout: 10_000,
  });
  return stdout.trim();
}

function spawnTracked(command, args, options) {
  const p = spawn(command, args, { stdio: ['ignore', 'ignore', 'pipe'], ...options });
  processes.add(p);
  p.stderrTail = '';
  p.stderr?.on('data', (chunk) => {
    p.stderrTail = (p.stderrTail + chunk).slice(-8000);
  });
  p.once('exit', () => processes.delete(p));
  return p;
}

/** A redis-server on a free port, in a temporary directory; `args` are extra options. */
export async function startRedis(args = [], name = 'redis') {
  for (let attempt = 1; ; attempt++) {
    const port = await freePort();
    const dir = tempDir(name);
    const p = spawnTracked('redis-server', [
      '--port', String(port), '--bind', '127.0.0.1', '--dir', dir, '--save', '',
      '--appendonly', 'no', '--protected-mode', 'no', '--logfile', path.join(dir, 'redis.log'),
      ...args.map(String),
    ]);
    const exited = new Promise((resolve) => p.once('exit', () => resolve(false)));
    const up = waitFor(`redis-server on ${port}`, async () => (await cli(port, 'PING')) === 'PONG', 15_000);
    if (await Promise.race([up.then(() => true), exited])) {
      return {
        port,
        dir,
        process: p,
        url: `redis://127.0.0.1:${port}`,
        pause: () => p.kill('SIGSTOP'),
        resume: () => p.kill('SIGCONT'),
        stop: () => stopProcess(p),
      };
    }
    if (attempt >= 3) throw new Error(`redis-server would not start (port ${port}): see ${dir}/redis.log`);
  }
}

/** A node-redis client for a test; errors of a connection that is away are expected. */
/**
 * A node-redis client of one node. `disableClientInfo`: the tests run on Redis 7.0, which
 * has no CLIENT SETINFO, and node-redis sends it at every (re)connect; a connection killed
 * during that handshake can hand its error to a pending command (README, Redis before 7.2).
 */
export async function nodeClient(url, RESP = 2, extra = {}) {
  const client = createClient({ url, RESP, disableClientInfo: true, ...extra });
  client.on('error', () => {});
  clients.add(client);
  await client.connect();
  return client;
}

/** Every key of a node and its value (DUMP), to show that nothing was written. */
export async function snapshot(client) {
  const out = new Map();
  for await (const keys of client.scanIterator({ COUNT: 1000 })) {
    for (const key of keys) out.set(key, (await client.sendCommand(['DUMP', key]))?.toString('hex') ?? null);
  }
  return out;
}

// --- Sentinel -----------------------------------------------------------------------------

/** One primary, one replica, three sentinels monitoring them as `mymaster`. */
export async function startSentinelSetup() {
  const primary = await startRedis([], 'primary');
  const replica = await startRedis(['--replicaof', '127.0.0.1', primary.port], 'replica');
  await waitFor('the replica to sync', async () => (await cli(replica.port, 'INFO', 'replication')).includes('master_link_status:up'));
  const sentinels = [];
  for (let i = 0; i < 3; i++) {
    const port = await freePort();
    const dir = tempDir('sentinel');
    const conf = path.join(dir, 'sentinel.conf');
    writeFileSync(
      conf,
      [
        `port ${port}`,
        'bind 127.0.0.1',
        'protected-mode no',
        `dir ${dir}`,
        `logfile ${path.join(dir, 'sentinel.log')}`,
        `sentinel monitor mymaster 127.0.0.1 ${primary.port} 2`,
        'sentinel down-after-milliseconds mymaster 1000',
        'sentinel failover-timeout mymaster 5000',
        'sentinel parallel-syncs mymaster 1',
        '',
      ].join('\n'),
    );
    const p = spawnTracked('redis-server', [conf, '--sentinel']);
    await waitFor(`sentinel on ${port}`, async () => (await cli(port, 'PING')) === 'PONG');
    sentinels.push({ port, process: p });
  }
  for (const s of sentinels) {
    await waitFor('the sentinels to know the replica and each other', async () => {
      const master = await cli(s.port, 'SENTINEL', 'MASTER', 'mymaster');
      const fields = master.split('\n');
      const field = (name) => fields[fields.indexOf(name) + 1];
      return Number(field('num-slaves')) >= 1 && Number(field('num-other-sentinels')) >= 2;
    }, 30_000, 200);
  }
  const masterPort = async () =>
    Number((await cli(sentinels[0].port, 'SENTINEL', 'GET-MASTER-ADDR-BY-NAME', 'mymaster')).split('\n')[1]);
  return { primary, replica, sentinels, masterPort };
}

export async function sentinelClient(setup, RESP = 2) {
  const client = createSentinel({
    name: 'mymaster',
    sentinelRootNodes: setup.sentinels.map((s) => ({ host: '127.0.0.1', port: s.port })),
    RESP,
  });
  client.on('error', () => {});
  clients.add(client);
  await client.connect();
  return client;
}

// --- Cluster ------------------------------------------------------------------------------

/** Three masters (no replicas), all slots served. */
export async function startCluster() {
  const nodes = [];
  for (let i = 0; i < 3; i++) {
    const dir = tempDir('cluster');
    const bus = await freePort();
    nodes.push(
      await startRedis(
        ['--cluster-enabled', 'yes', '--cluster-config-file', path.join(dir, 'nodes.conf'),
          '--cluster-port', bus, '--cluster-node-timeout', '5000'],
        'cluster',
      ),
    );
  }
  await run('redis-cli', ['--cluster', 'create', ...nodes.map((n) => `127.0.0.1:${n.port}`),
    '--cluster-replicas', '0', '--cluster-yes'], { timeout: 60_000 });
  for (const n of nodes) {
    await waitFor('cluster_state:ok', async () => (await cli(n.port, 'CLUSTER', 'INFO')).includes('cluster_state:ok'), 30_000, 100);
  }
  return { nodes, url: nodes[0].url };
}

export async function clusterClient(cluster, RESP = 2) {
  const client = createCluster({ rootNodes: cluster.nodes.map((n) => ({ url: n.url })), RESP });
  client.on('error', () => {});
  clients.add(client);
  await client.connect();
  return client;
}

// --- The janitor --------------------------------------------------------------------------

export function janitorBinary() {
  const bin = process.env.REGISTRY_JANITOR_BIN ?? path.join(REPO, 'target/debug/registry-janitor');
  if (!existsSync(bin)) {
    throw new Error(
      `the registry-janitor binary is missing at ${bin}: build it with ` +
        `\`cd ${REPO} && cargo build -p registry-janitor\` (or set REGISTRY_JANITOR_BIN to its path)`,
    );
  }
  return bin;
}

function janitorArgs({ url, layout, keyPrefix = '' }) {
  return ['--redis-url', url, '--layout', layout, '--key-prefix', keyPrefix, '--metrics-addr', 'off'];
}

function janitorEnv({ cluster = false, env = {} }) {
  // The guard is off: these tests fence live servers on purpose, again and again.
  return { ...process.env, JANITOR_GUARD: 'false', JANITOR_REDIS_CLUSTER: String(cluster), ...env };
}

/** `registry-janitor worker`, waited for until it reads the events stream. */
export async function startWorker(options, client) {
  const bin = janitorBinary();
  const extra = options.chunkSize ? ['--chunk-size', String(options.chunkSize)] : [];
  const p = spawnTracked(bin, ['worker', ...janitorArgs(options), ...extra], { env: janitorEnv(options) });
  const stream = `${options.keyPrefix ?? ''}registry:events`;
  await waitFor('the worker to join its consumer group', async () => {
    if (p.exitCode !== null) throw new Error(`the worker exited: ${p.stderrTail}`);
    const send = (args) => (options.cluster ? client.sendCommand(stream, true, args) : client.sendCommand(args));
    const consumers = await send(['XINFO', 'CONSUMERS', stream, 'registry-janitor']);
    return consumers.length > 0;
  }, 30_000, 100);
  return p;
}

/** `registry-janitor emit server-dead <serverId>`: the entry id. */
export async function emitServerDead(serverId, options) {
  const { stdout } = await run(janitorBinary(), ['emit', 'server-dead', serverId, ...janitorArgs(options)], {
    env: janitorEnv(options),
    timeout: 30_000,
  });
  return stdout.trim();
}
