// The errors this package throws, and how it reads the errors node-redis throws.
//
// node-redis error classes do not set `name`, and the application's client may come from
// another copy of the `redis` package than ours, so errors are recognised by their class
// name and their text, never with instanceof.

/** This server id was declared dead (the protocol's `FENCED` reply): close its sockets and
 * start again under a new server id. Never retry the write. */
export class FencedError extends Error {
  readonly code = 'FENCED' as const;
  readonly serverId: string;

  constructor(serverId: string, message?: string) {
    super(
      message ??
        `FENCED server ${serverId} was declared dead: close its sockets and start again under a new server id`,
    );
    this.name = 'FencedError';
    this.serverId = serverId;
  }
}

/** An identifier broke its rule; nothing was written. `rule` is the rule, as a sentence. */
export class InvalidIdError extends TypeError {
  readonly code = 'INVALID_ID' as const;
  /** Which identifier: 'server id', 'user id' or 'connection id'. */
  readonly kind: 'server id' | 'user id' | 'connection id';
  readonly rule: string;

  constructor(kind: InvalidIdError['kind'], rule: string, got: string) {
    super(`${rule}: got ${got}`);
    this.name = 'InvalidIdError';
    this.kind = kind;
    this.rule = rule;
  }
}

/** A call on a ConnectionServer after close(). */
export class ClosedError extends Error {
  readonly code = 'CLOSED' as const;
  constructor(serverId: string) {
    super(`ConnectionServer ${serverId} is closed`);
    this.name = 'ClosedError';
  }
}

/** Redis did not answer an attempt in time (the command may still be queued or in flight;
 * each script is idempotent, and a later call of the same entry waits for it before it
 * sends its own), or a call waited for an earlier attempt of its entry past its time. */
export class RedisTimeoutError extends Error {
  readonly code = 'TIMEOUT' as const;
  constructor(ms: number) {
    super(`Redis did not answer within ${ms} ms`);
    this.name = 'RedisTimeoutError';
  }
}

const REPLY_CLASSES = new Set(['ErrorReply', 'SimpleError', 'BlobError']);

/** The class names of a value's prototype chain. */
function classNames(err: unknown): string[] {
  const names: string[] = [];
  let p = err !== null && typeof err === 'object' ? Object.getPrototypeOf(err) : null;
  while (p && p !== Object.prototype) {
    if (p.constructor?.name) names.push(p.constructor.name);
    p = Object.getPrototypeOf(p);
  }
  return names;
}

/** The code of a Redis error reply (`FENCED`, `NOSCRIPT`, `LOADING`...), or undefined when
 * `err` is not an error reply. */
export function replyCode(err: unknown): string | undefined {
  if (!(err instanceof Error) || !classNames(err).some((n) => REPLY_CLASSES.has(n))) {
    return undefined;
  }
  return /^[A-Z_-]+/.exec(err.message)?.[0];
}

export function isFencedReply(err: unknown): boolean {
  return replyCode(err) === 'FENCED';
}

export function isNoScript(err: unknown): boolean {
  return replyCode(err) === 'NOSCRIPT';
}

/** A cluster's refusal of route.lua / route_user.lua (`no-cluster` flag). */
export function isNoClusterRefusal(err: unknown): boolean {
  return replyCode(err) !== undefined && (err as Error).message.includes('no-cluster');
}

/** Error replies for states that pass (the janitor's own list, src/error.rs, without MOVED
 * and ASK, which a cluster client follows itself: one that reaches us is a plain client
 * talking to a cluster, which waiting does not fix). */
const TRANSIENT_CODES = new Set([
  'BUSY',
  'LOADING',
  'NOREPLICAS',
  'MISCONF',
  'OOM',
  'MASTERDOWN',
  'READONLY',
  'TRYAGAIN',
  'CLUSTERDOWN',
  'UNBLOCKED',
]);

/** node-redis errors of a connection that is away, comes back, or is being replaced. */
const TRANSIENT_CLASSES = new Set([
  'SocketClosedUnexpectedlyError',
  'ConnectionTimeoutError',
  'SocketTimeoutError',
  'TimeoutError',
  'SocketTimeoutDuringMaintenanceError',
  'CommandTimeoutDuringMaintenanceError',
  'ClientOfflineError',
  'ReconnectStrategyError',
  'RootNodesUnavailableError',
  'RedisTimeoutError',
]);

const TRANSIENT_SOCKET_CODES = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'EPIPE',
  'ETIMEDOUT',
  'EHOSTUNREACH',
  'ENETUNREACH',
  'EAI_AGAIN',
]);

/** Plain Errors node-redis throws while a Sentinel setup or a cluster changes its mind. */
const TRANSIENT_MESSAGES = [
  /^no valid master node/,
  /^None of the sentinels are available/,
  /^Couldn't connect to any sentinel/i,
  /^Master Node Not Enumerated/,
  /^Socket closed unexpectedly/,
  /^Connection timeout/,
  /^Cannot find node /,
  /^All the root nodes are unavailable/,
];

/** Whether waiting and trying again may succeed: a state that passes (LOADING, BUSY,
 * READONLY, MASTERDOWN, TRYAGAIN, CLUSTERDOWN, NOREPLICAS, OOM, ...) or a connection that
 * is away. FENCED, NOSCRIPT, ERR, NOPERM, WRONGTYPE and the like are not. */
export function isTransient(err: unknown): boolean {
  if (!(err instanceof Error)) return false;
  const code = replyCode(err);
  if (code !== undefined) {
    if (code === 'ERR') return err.message.startsWith('ERR max number of clients reached');
    return TRANSIENT_CODES.has(code);
  }
  if (classNames(err).some((n) => TRANSIENT_CLASSES.has(n))) return true;
  const sys = (err as { code?: unknown }).code;
  if (typeof sys === 'string' && TRANSIENT_SOCKET_CODES.has(sys)) return true;
  if (TRANSIENT_MESSAGES.some((m) => m.test(err.message))) return true;
  const cause = (err as { cause?: unknown }).cause;
  return cause !== undefined && cause !== err && isTransient(cause);
}
