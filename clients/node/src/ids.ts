// Identifiers and their rules (docs/specification.md "Identifiers", docs/connections.md).
// Every call checks its identifiers before it sends anything to Redis.

import { InvalidIdError } from './errors.js';

/** A user id: any bytes, given as a string (sent as UTF-8) or as bytes. */
export type UserId = string | Uint8Array;

export const SERVER_ID_RULE =
  "server id must be 1 to 200 bytes of printable ASCII without whitespace, '{' or '}'";
export const CONNECTION_ID_RULE =
  "connection id must be 1 to 200 bytes of printable ASCII without whitespace, '{' or '}'";
export const USER_ID_RULE =
  'user id must be 1 to 512 bytes (a well-formed string, without lone surrogates, sent as UTF-8; or bytes)';

// Printable ASCII (0x21-0x7E) but for '{' (0x7B) and '}' (0x7D): the pattern of route.lua.
const SERVER_ID = /^[!-z|~]{1,200}$/;

/** How a rejected value is shown in an error message: quoted, cut at 60 characters. */
function shown(value: unknown): string {
  if (value instanceof Uint8Array) return `${value.length} bytes`;
  if (typeof value !== 'string') return value === null ? 'null' : typeof value;
  const text = JSON.stringify(value.length > 60 ? value.slice(0, 60) : value);
  return value.length > 60 ? `${text}... (${Buffer.byteLength(value)} bytes)` : text;
}

export function checkServerId(id: unknown): string {
  if (typeof id !== 'string' || !SERVER_ID.test(id)) {
    throw new InvalidIdError('server id', SERVER_ID_RULE, shown(id));
  }
  return id;
}

export function checkConnectionId(id: unknown): string {
  if (typeof id !== 'string' || !SERVER_ID.test(id)) {
    throw new InvalidIdError('connection id', CONNECTION_ID_RULE, shown(id));
  }
  return id;
}

/** String.prototype.isWellFormed (Node 20): no lone surrogate, which UTF-8 would send as
 * U+FFFD, so that two different strings would be one user. */
const isWellFormed = (s: string): boolean => (s as unknown as { isWellFormed(): boolean }).isWellFormed();

/** Checks a user id and returns it as node-redis sends it: a string, or a Buffer. In layout
 * conns any bytes will do too: in the reverse-set member `<connection> <user>` the
 * connection id comes first and holds no space, so the member splits at its first space
 * whatever the user id holds (docs/connections.md). */
export function checkUserId(user: unknown): string | Buffer {
  if (typeof user === 'string') {
    const n = Buffer.byteLength(user);
    if (n >= 1 && n <= 512 && isWellFormed(user)) return user;
  } else if (user instanceof Uint8Array) {
    if (user.length >= 1 && user.length <= 512) {
      return Buffer.isBuffer(user) ? user : Buffer.from(user.buffer, user.byteOffset, user.length);
    }
  }
  throw new InvalidIdError('user id', USER_ID_RULE, shown(user));
}

let lastIncarnationMs = 0;

/** `base` + '#' + the time in unix ms: a new server id, a new incarnation of the same
 * machine (`gw-7` -> `gw-7#1732181000123`; `gw-7#1732181000123` -> `gw-7#<now>`). Two calls
 * in one process never return the same id. */
export function newServerId(base: string): string {
  const name = typeof base === 'string' ? base.split('#')[0] : base;
  const ms = Math.max(Date.now(), lastIncarnationMs + 1);
  lastIncarnationMs = ms;
  const id = `${name}#${ms}`;
  if (typeof name !== 'string' || name.length === 0 || !SERVER_ID.test(id)) {
    throw new InvalidIdError('server id', SERVER_ID_RULE, shown(base));
  }
  return id;
}
