// The whole scenario, in both layouts: real processes (redis-server, registry-janitor's
// worker and reconciler, socket.io servers, 1,000 client connections, the sender, the
// presence consumer), real faults. Each check of lib/checks.js is asserted.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runScenario } from '../lib/scenario.js';
import { checks } from '../lib/checks.js';
import { render } from '../lib/render.js';

for (const layout of ['keys', 'conns']) {
  test(`socket.io fleet, layout ${layout}: SIGKILL, SIGSTOP/SIGCONT, SIGTERM`, { timeout: 300_000 }, async () => {
    const r = await runScenario({ layout });
    const cs = checks(r);
    // The figures, on stderr (node --test passes a test file's stderr through).
    process.stderr.write(`${render(r, cs)}\n`);
    for (const c of cs) assert.ok(c.ok, `${c.name}: ${c.detail}`);
  });
}
