// The protocol on a Redis Cluster, in the order of docs/specification.md "On a Redis
// Cluster: the order of the steps". The forward entry (or the user's Hash, layout conns)
// and the server's keys are in different slots, so no one script holds both: the member
// is written last, by the script that checks the fence.

import { text, type Conn } from './conn.js';
import { isFencedReply } from './errors.js';
import { checkServerId } from './ids.js';
import type { Arg, Entry, Keys } from './keys.js';
import { stillWanted, type Attempt } from './retry.js';
import { evalsha, type ScriptName } from './scripts.js';

/** How a registration's steps ended. */
export interface RegisterOutcome {
  /** The FENCED reply, if the fence refused the member. */
  fenced?: unknown;
}

/** Register, steps 1 to 3: `EXISTS F`; if fenced, the script with F, N, U only (it refuses
 * and notes it) and no forward entry. Otherwise the forward entry, then the script with F,
 * N, U only. `onForwardWritten` is called before the forward write is sent, so that the
 * caller knows to take it back (release.lua) if the member is refused. No step is sent
 * once `attempt` was given up on (its deadline passed). */
export async function registerSteps(
  conn: Conn,
  keys: Keys,
  serverId: string,
  script: ScriptName,
  entry: Entry,
  args: Arg[],
  timeoutMs: number,
  onForwardWritten: () => void,
  attempt?: Attempt,
): Promise<RegisterOutcome> {
  const own = [keys.fenced(serverId), keys.refused(serverId), keys.users(serverId)];
  const fenced = (await conn.send(own[0], ['EXISTS', own[0]], timeoutMs)) === 1;
  if (fenced) {
    // No forward entry: it could replace the entry of a user now on a live server. The
    // script refuses and notes the refusal.
    stillWanted(attempt, timeoutMs);
    try {
      await evalsha(conn, script, own, args, timeoutMs, false, attempt);
    } catch (err) {
      if (isFencedReply(err)) return { fenced: err };
      throw err;
    }
    // It took the member: the fence expired since it was read. The steps go on, the
    // forward entry first, then the script again.
  }
  stillWanted(attempt, timeoutMs);
  onForwardWritten();
  await conn.send(entry.key, entry.write, timeoutMs);
  stillWanted(attempt, timeoutMs);
  try {
    await evalsha(conn, script, own, args, timeoutMs, false, attempt);
    return {};
  } catch (err) {
    if (isFencedReply(err)) return { fenced: err };
    throw err;
  }
}

/** release.lua: the forward entry goes only if it still names the server. 0 or 1. */
export async function release(conn: Conn, entry: Entry, timeoutMs: number, attempt?: Attempt): Promise<number> {
  return Number(await evalsha(conn, 'release', [entry.key], entry.release, timeoutMs, false, attempt));
}

/** Unregister: release.lua on the forward entry, then the script with F, N, U only (it
 * answers 0, or FENCED). Returns the entries release.lua deleted; throws the FENCED reply. */
export async function unregisterSteps(
  conn: Conn,
  keys: Keys,
  serverId: string,
  script: ScriptName,
  entry: Entry,
  args: Arg[],
  timeoutMs: number,
  onReleased: (deleted: number) => void,
  attempt?: Attempt,
): Promise<void> {
  onReleased(await release(conn, entry, timeoutMs, attempt));
  stillWanted(attempt, timeoutMs);
  const own = [keys.fenced(serverId), keys.refused(serverId), keys.users(serverId)];
  await evalsha(conn, script, own, args, timeoutMs, false, attempt);
}

/** Heartbeat: heartbeat.lua with F, N, A only, then, if it answered 1, ZADD servers. */
export async function heartbeatSteps(
  conn: Conn,
  keys: Keys,
  serverId: string,
  ttlMs: number,
  nowMs: number,
  timeoutMs: number,
): Promise<void> {
  const own = [keys.fenced(serverId), keys.refused(serverId), keys.alive(serverId)];
  const reply = await evalsha(conn, 'heartbeat', own, [serverId, String(ttlMs), String(nowMs)], timeoutMs);
  if (Number(reply) === 1) {
    await conn.send(keys.servers(), ['ZADD', keys.servers(), String(nowMs), serverId], timeoutMs);
  }
}

/** Whether `owner` is a server id that is neither fenced nor past its liveness: EXISTS
 * server:{O}:fenced and EXISTS server:{O}:alive (one slot). A value that is no valid
 * server id has no liveness key and never goes into a key name: not live. */
export async function isLive(conn: Conn, keys: Keys, owner: string, timeoutMs: number): Promise<boolean> {
  try {
    checkServerId(owner);
  } catch {
    return false;
  }
  const [fenced, alive] = await Promise.all([
    conn.send(keys.fenced(owner), ['EXISTS', keys.fenced(owner)], timeoutMs),
    conn.send(keys.alive(owner), ['EXISTS', keys.alive(owner)], timeoutMs),
  ]);
  return fenced === 0 && alive === 1;
}

/** Route (layouts hash, keys): `read` (HGET registry <user>, or GET user:<user>) the owner
 * O, then O's fence and liveness keys. */
export async function routeSteps(conn: Conn, keys: Keys, read: Arg[], timeoutMs: number): Promise<string | null> {
  const owner = text(await conn.send(read[1], read, timeoutMs));
  if (owner === null) return null;
  return (await isLive(conn, keys, owner, timeoutMs)) ? owner : null;
}

/** Route, layout conns: the servers of the user's Hash (HVALS C; HGETALL in the spec, the
 * connection ids are not needed), then each distinct server's fence and liveness keys;
 * the live ones, sorted. */
export async function routeUserSteps(conn: Conn, keys: Keys, hashKey: Arg, timeoutMs: number): Promise<string[]> {
  const values = await conn.send(hashKey, ['HVALS', hashKey], timeoutMs);
  const servers = [...new Set((values as unknown[]).map(text).filter((s): s is string => s !== null))].sort();
  const live = await Promise.all(servers.map((s) => isLive(conn, keys, s, timeoutMs)));
  return servers.filter((_, i) => live[i]);
}
