// Key names (docs/specification.md "Keys and their owners"); every one carries keyPrefix.

export type Layout = 'hash' | 'keys' | 'conns';
export type Arg = string | Buffer;

export const LAYOUTS: readonly Layout[] = ['hash', 'keys', 'conns'];

export function checkLayout(layout: unknown): Layout {
  if (!LAYOUTS.includes(layout as Layout)) {
    throw new TypeError(`layout must be 'hash', 'keys' or 'conns', got ${JSON.stringify(layout)}`);
  }
  return layout as Layout;
}

/** Joins key parts: a string if every part is one, else a Buffer (binary user ids). */
function join(...parts: Arg[]): Arg {
  if (parts.every((p) => typeof p === 'string')) return parts.join('');
  return Buffer.concat(parts.map((p) => (typeof p === 'string' ? Buffer.from(p) : p)));
}

export class Keys {
  constructor(readonly prefix: string) {
    if (typeof prefix !== 'string') throw new TypeError('keyPrefix must be a string');
  }

  private server(id: string, what: string): string {
    return `${this.prefix}server:{${id}}:${what}`;
  }
  /** F: the fence, written by the janitor's workers. */
  fenced(id: string): string {
    return this.server(id, 'fenced');
  }
  /** N: the refusal notes. */
  refused(id: string): string {
    return this.server(id, 'refused');
  }
  /** U: the reverse set. */
  users(id: string): string {
    return this.server(id, 'users');
  }
  /** A: the liveness key. */
  alive(id: string): string {
    return this.server(id, 'alive');
  }
  servers(): string {
    return `${this.prefix}servers`;
  }
  /** Layout hash: the forward Hash. */
  registry(): string {
    return `${this.prefix}registry`;
  }
  /** Layout keys: the user's forward String. */
  user(user: Arg): Arg {
    return join(this.prefix, 'user:', user);
  }
  /** Layout conns: the user's Hash of connections. */
  userConns(user: Arg): Arg {
    return join(this.prefix, 'user:{', user, '}:conns');
  }
}

/** One forward entry, as the steps of the protocol need it. */
export interface Entry {
  /** The key that holds it (R, or C in layout conns). */
  key: Arg;
  /** The plain write of the entry naming the server (the cluster's first step). */
  write: Arg[];
  /** release.lua's ARGV: the field or user, the server, 'hash' or 'keys'. */
  release: Arg[];
}

export function entryOf(
  keys: Keys,
  layout: Layout,
  user: Arg,
  connection: string | undefined,
  serverId: string,
): Entry {
  switch (layout) {
    case 'hash':
      return {
        key: keys.registry(),
        write: ['HSET', keys.registry(), user, serverId],
        release: [user, serverId, 'hash'],
      };
    case 'keys':
      return {
        key: keys.user(user),
        write: ['SET', keys.user(user), serverId],
        release: [user, serverId, 'keys'],
      };
    case 'conns': {
      const key = keys.userConns(user);
      return {
        key,
        write: ['HSET', key, connection as string, serverId],
        release: [connection as string, serverId, 'hash'],
      };
    }
  }
}
