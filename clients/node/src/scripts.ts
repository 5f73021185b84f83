// The protocol's Lua scripts, and how they are run: EVALSHA (or EVALSHA_RO), loading the
// script after NOSCRIPT and trying once more; never EVAL every time.
//
// The sources are the repository's protocol/*.lua (the one source of truth): the build
// copies them into this package's scripts/ directory (tools/copy-scripts.mjs), and a test
// fails if that copy differs. Run from a checkout without a build, protocol/ is read.

import { createHash } from 'node:crypto';
import { existsSync, readFileSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

import type { Conn } from './conn.js';
import { isNoClusterRefusal, isNoScript, replyCode } from './errors.js';
import type { Arg } from './keys.js';
import { stillWanted, type Attempt } from './retry.js';

export const SCRIPT_NAMES = [
  'heartbeat',
  'heartbeat_servers',
  'register',
  'unregister',
  'release',
  'route',
  'register_conn',
  'unregister_conn',
  'route_user',
] as const;

export type ScriptName = (typeof SCRIPT_NAMES)[number];

/** Where the scripts are read from: this package's copy, else the repository's protocol/. */
export const SCRIPTS_DIR = [
  fileURLToPath(new URL('../scripts/', import.meta.url)),
  fileURLToPath(new URL('../../../protocol/', import.meta.url)),
].find((dir) => existsSync(`${dir}heartbeat.lua`));

function load(): Readonly<Record<ScriptName, string>> {
  if (SCRIPTS_DIR === undefined) {
    throw new Error(
      '@registry-janitor/client: the protocol scripts are missing; run `npm run build` in clients/node',
    );
  }
  const sources = {} as Record<ScriptName, string>;
  for (const name of SCRIPT_NAMES) sources[name] = readFileSync(`${SCRIPTS_DIR}${name}.lua`, 'utf8');
  return Object.freeze(sources);
}

/** The Lua sources of the protocol, by name (`scripts.register` is register.lua). */
export const scripts = load();

/** The SHA1 of each script, as EVALSHA takes it. */
export const scriptShas: Readonly<Record<ScriptName, string>> = Object.freeze(
  Object.fromEntries(
    SCRIPT_NAMES.map((n) => [n, createHash('sha1').update(scripts[n]).digest('hex')]),
  ) as Record<ScriptName, string>,
);

/** Runs a script by its SHA1 (EVALSHA, or EVALSHA_RO with `readOnly`). After NOSCRIPT
 * (a restart, a failover, SCRIPT FLUSH, a new cluster master) it loads the script on the
 * node of `keys[0]` and runs it once more (unless `attempt` was given up on meanwhile). */
export async function evalsha(
  conn: Conn,
  name: ScriptName,
  keys: Arg[],
  args: Arg[],
  timeoutMs?: number,
  readOnly = false,
  attempt?: Attempt,
): Promise<unknown> {
  const command: Arg[] = [readOnly ? 'EVALSHA_RO' : 'EVALSHA', scriptShas[name], String(keys.length), ...keys, ...args];
  try {
    try {
      return await conn.send(keys[0], command, timeoutMs);
    } catch (err) {
      if (!isNoScript(err)) throw err;
      stillWanted(attempt, timeoutMs);
      await conn.send(keys[0], ['SCRIPT', 'LOAD', scripts[name]], timeoutMs);
      stillWanted(attempt, timeoutMs);
      return await conn.send(keys[0], command, timeoutMs);
    }
  } catch (err) {
    throw conn.topology === 'cluster' ? err : notACluster(name, err);
  }
}

/** A cluster reached through a plain client: the cluster's refusal of a script (`no-cluster`,
 * or a redirection, or keys in several slots) as an error that says what to do. */
function notACluster(name: ScriptName, err: unknown): unknown {
  const code = replyCode(err);
  const cluster = code === 'MOVED' || code === 'ASK' || code === 'CROSSSLOT' || isNoClusterRefusal(err);
  if (!cluster) return err;
  return new Error(
    `${name}.lua: this Redis is a cluster (${(err as Error).message}); give a cluster client ` +
      '(createCluster), with which the package runs the protocol in single-slot steps',
    { cause: err },
  );
}
