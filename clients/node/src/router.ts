// Where to send a message for a user: route.lua / route_user.lua (read-only, EVALSHA_RO)
// on one node or behind Sentinel, single-slot steps on a cluster. A lookup never returns a
// server that is fenced (declared dead) or past its liveness.

import { routeSteps, routeUserSteps } from './cluster.js';
import { connOf, text, type Conn } from './conn.js';
import { isNoScript, isTransient, replyCode } from './errors.js';
import { checkUserId, type UserId } from './ids.js';
import { checkLayout, Keys, type Arg, type Layout } from './keys.js';
import { retryPolicy, withRetry, type RetryOptions, type RetryPolicy } from './retry.js';
import { evalsha, type ScriptName } from './scripts.js';

export interface RouterOptions {
  layout?: Layout;
  keyPrefix?: string;
  retry?: RetryOptions;
}

/** Lookups sent at once by routeMany / routeUsers (node-redis pipelines what is sent in
 * one tick). */
const BATCH = 1000;

export class Router {
  readonly layout: Layout;
  readonly keyPrefix: string;
  private readonly conn: Conn;
  private readonly keys: Keys;
  private readonly retry: RetryPolicy;
  /** Redis (or a proxy, or the ACL user) refused EVALSHA_RO, and EVALSHA answered. */
  private readOnlyRefused = false;

  constructor(redis: unknown, options: RouterOptions = {}) {
    this.conn = connOf(redis);
    this.layout = checkLayout(options.layout ?? 'keys');
    this.keyPrefix = options.keyPrefix ?? '';
    this.keys = new Keys(this.keyPrefix);
    this.retry = retryPolicy(options.retry);
  }

  /** The server that holds `user` (layouts hash and keys), or null: none, or its owner is
   * fenced or past its liveness. */
  async route(user: UserId): Promise<string | null> {
    this.needs('route', ['hash', 'keys']);
    const u = checkUserId(user);
    return this.routeChecked(u);
  }

  /** route() of many users, in order, pipelined. */
  async routeMany(users: Iterable<UserId>): Promise<(string | null)[]> {
    this.needs('routeMany', ['hash', 'keys']);
    const checked = [...users].map(checkUserId);
    return batched(checked, (u) => this.routeChecked(u));
  }

  /** Layout conns: the distinct live servers of the user's connections, sorted (empty when
   * none). */
  async routeUser(user: UserId): Promise<string[]> {
    this.needs('routeUser', ['conns']);
    return this.routeUserChecked(checkUserId(user));
  }

  /** routeUser() of many users, in order, pipelined. */
  async routeUsers(users: Iterable<UserId>): Promise<string[][]> {
    this.needs('routeUsers', ['conns']);
    const checked = [...users].map(checkUserId);
    return batched(checked, (u) => this.routeUserChecked(u));
  }

  private needs(call: string, layouts: Layout[]): void {
    if (!layouts.includes(this.layout)) {
      const other = this.layout === 'conns' ? 'routeUser' : 'route';
      throw new TypeError(`${call} is for layout ${layouts.join(' or ')}; this Router is layout ${this.layout}: use ${other}`);
    }
  }

  private routeChecked(user: Arg): Promise<string | null> {
    const forward = this.layout === 'hash' ? this.keys.registry() : this.keys.user(user);
    if (this.conn.topology === 'cluster') {
      const read: Arg[] = this.layout === 'hash' ? ['HGET', forward, user] : ['GET', forward];
      return withRetry(this.retry, (t) => routeSteps(this.conn, this.keys, read, t));
    }
    return withRetry(this.retry, async (t) =>
      text(await this.readOnly('route', forward, [user, this.layout, this.keyPrefix], t)),
    );
  }

  private routeUserChecked(user: Arg): Promise<string[]> {
    const hash = this.keys.userConns(user);
    if (this.conn.topology === 'cluster') {
      return withRetry(this.retry, (t) => routeUserSteps(this.conn, this.keys, hash, t));
    }
    return withRetry(this.retry, async (t) => {
      const reply = await this.readOnly('route_user', hash, [this.keyPrefix], t);
      return (reply as unknown[]).map((s) => text(s) as string);
    });
  }

  /** A read-only script on one node: EVALSHA_RO, or EVALSHA where EVALSHA_RO is refused
   * (an unknown command, an ACL user without it: any error reply that is neither a state
   * that passes, nor NOSCRIPT), from then on once EVALSHA answered. */
  private async readOnly(name: ScriptName, key: Arg, args: Arg[], timeoutMs: number): Promise<unknown> {
    const readOnly = !this.readOnlyRefused;
    try {
      return await evalsha(this.conn, name, [key], args, timeoutMs, readOnly);
    } catch (err) {
      // Not a refusal of EVALSHA_RO: no error reply, a state that passes, NOSCRIPT after a
      // load, or a cluster's refusal (already an Error that says so).
      if (!readOnly || replyCode(err) === undefined || isTransient(err) || isNoScript(err)) throw err;
      const reply = await evalsha(this.conn, name, [key], args, timeoutMs, false);
      this.readOnlyRefused = true;
      return reply;
    }
  }
}

/** `fn` of every item, in order, BATCH at a time. */
async function batched<T, R>(items: T[], fn: (item: T) => Promise<R>): Promise<R[]> {
  const out: R[] = [];
  for (let i = 0; i < items.length; i += BATCH) {
    out.push(...(await Promise.all(items.slice(i, i + BATCH).map(fn))));
  }
  return out;
}
