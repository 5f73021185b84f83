// Retries of calls that meet a state that passes (a failover, a restart, a full queue, a
// connection that is away): capped exponential backoff with jitter, within a deadline.

import { isTransient, RedisTimeoutError } from './errors.js';

export interface RetryOptions {
  /** Attempts in all, the first one included (default 10). */
  attempts?: number;
  /** The first backoff (default 50 ms); it doubles after each failed attempt... */
  baseDelayMs?: number;
  /** ...up to this (default 2000 ms). */
  maxDelayMs?: number;
  /** The most a call may take in all, its attempts and backoffs included (default
   * 10000 ms). An attempt that Redis has not answered when it ends fails with
   * RedisTimeoutError. */
  timeoutMs?: number;
}

export type RetryPolicy = Required<RetryOptions>;

export const DEFAULT_RETRY: RetryPolicy = Object.freeze({
  attempts: 10,
  baseDelayMs: 50,
  maxDelayMs: 2000,
  timeoutMs: 10_000,
});

export function retryPolicy(options: RetryOptions | undefined): RetryPolicy {
  const policy = { ...DEFAULT_RETRY, ...options };
  for (const [name, value] of Object.entries(policy)) {
    if (!Number.isFinite(value) || value < 0 || (name === 'attempts' && value < 1)) {
      throw new TypeError(`retry.${name} must be a number of at least ${name === 'attempts' ? 1 : 0}`);
    }
  }
  return policy;
}

export const sleep = (ms: number) => new Promise<void>((resolve) => setTimeout(resolve, ms));

/** `promise`, or a RedisTimeoutError after `ms`. */
export function withDeadline<T>(promise: Promise<T>, ms: number): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  const deadline = new Promise<never>((_, reject) => {
    timer = setTimeout(() => reject(new RedisTimeoutError(ms)), ms);
  });
  return Promise.race([promise, deadline]).finally(() => clearTimeout(timer));
}

/** One attempt of withRetry. `abandoned` is set once the call no longer waits for it (its
 * deadline passed, or it failed): an attempt of several commands checks it before sending
 * the next, so that nothing more of an attempt given up on is sent. */
export interface Attempt {
  abandoned: boolean;
}

/** Throws a RedisTimeoutError if `attempt` was given up on: send nothing more of it. */
export function stillWanted(attempt: Attempt | undefined, timeoutMs: number | undefined): void {
  if (attempt?.abandoned) throw new RedisTimeoutError(timeoutMs ?? 0);
}

/** Runs `attempt(timeoutMs, attempt)` until it succeeds, fails with an error that is not
 * transient, or runs out of attempts or time; each attempt gets the time left. */
export async function withRetry<T>(
  policy: RetryPolicy,
  attempt: (timeoutMs: number, attempt: Attempt) => Promise<T>,
): Promise<T> {
  const deadline = Date.now() + policy.timeoutMs;
  for (let n = 1; ; n++) {
    const left = Math.max(1, deadline - Date.now());
    const state: Attempt = { abandoned: false };
    try {
      return await withDeadline(attempt(left, state), left);
    } catch (err) {
      state.abandoned = true;
      if (!isTransient(err) || n >= policy.attempts) throw err;
      const cap = Math.min(policy.maxDelayMs, policy.baseDelayMs * 2 ** (n - 1));
      const delay = cap / 2 + (Math.random() * cap) / 2;
      if (Date.now() + delay >= deadline) throw err;
      await sleep(delay);
    }
  }
}
