// @registry-janitor/client: the connection-server protocol of registry-janitor for Node.js
// (node-redis v5: a single node, Sentinel or a cluster; RESP2 or RESP3).

export { ConnectionServer } from './server.js';
export type { ConnectionServerOptions, HeartbeatLost, HeartbeatRestored } from './server.js';
export { Router } from './router.js';
export type { RouterOptions } from './router.js';
export { FencedError, InvalidIdError, ClosedError, RedisTimeoutError, isTransient } from './errors.js';
export { newServerId, SERVER_ID_RULE, USER_ID_RULE, CONNECTION_ID_RULE } from './ids.js';
export type { UserId } from './ids.js';
export type { Layout } from './keys.js';
export { scripts, scriptShas, SCRIPT_NAMES, SCRIPTS_DIR } from './scripts.js';
export type { ScriptName } from './scripts.js';
export { topologyOf } from './conn.js';
export type { Topology } from './conn.js';
export { DEFAULT_RETRY } from './retry.js';
export type { RetryOptions } from './retry.js';
