#!/usr/bin/env node
// Runs the scenario and prints its figures and checks.
//
//   npm run scenario -- [--layout keys|conns|both] [--connections 1000] [--ttl-ms 3000]
//     [--grace-ms 3000] [--key-prefix P] [--json] [--keep]
//
// Exit status 1 when a check fails. --keep keeps the temporary directory (logs of every
// process) even on success.
import { parseArgs } from 'node:util';
import { runScenario } from './lib/scenario.js';
import { checks } from './lib/checks.js';
import { render } from './lib/render.js';

const { values: a } = parseArgs({
  options: {
    layout: { type: 'string', default: 'keys' },
    connections: { type: 'string', default: '1000' },
    json: { type: 'boolean', default: false },
    keep: { type: 'boolean', default: false },
    'ttl-ms': { type: 'string' },
    'grace-ms': { type: 'string' },
    'key-prefix': { type: 'string', default: '' },
  },
});
const layouts = a.layout === 'both' ? ['keys', 'conns'] : a.layout === 'all' ? ['hash', 'keys', 'conns'] : [a.layout];
let failed = 0;
for (const layout of layouts) {
  const o = { layout, connections: Number(a.connections), keep: a.keep, keyPrefix: a['key-prefix'] };
  if (a['ttl-ms']) o.ttlMs = Number(a['ttl-ms']);
  if (a['grace-ms']) o.graceMs = Number(a['grace-ms']);
  const r = await runScenario(o);
  const cs = checks(r);
  failed += cs.filter((c) => !c.ok).length;
  if (a.json) console.log(JSON.stringify({ result: r, checks: cs }, null, 1));
  else console.log(render(r, cs));
}
process.exit(failed ? 1 : 0);
