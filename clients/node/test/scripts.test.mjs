// The package's copy of the protocol scripts is the repository's protocol/, byte for byte.
import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { readdirSync, readFileSync } from 'node:fs';
import path from 'node:path';
import { test } from 'node:test';

import { SCRIPT_NAMES, SCRIPTS_DIR, scripts, scriptShas } from '../dist/index.js';
import { PACKAGE, REPO } from './harness.mjs';

const protocol = path.join(REPO, 'protocol');
const copy = path.join(PACKAGE, 'scripts');

test('the package copy of the Lua scripts is protocol/, file for file', () => {
  const lua = (dir) => readdirSync(dir).filter((n) => n.endsWith('.lua')).sort();
  assert.deepEqual(lua(copy), lua(protocol), 'the same script names (run `npm run build` to copy them)');
  for (const name of lua(protocol)) {
    assert.ok(
      readFileSync(path.join(copy, name)).equals(readFileSync(path.join(protocol, name))),
      `scripts/${name} differs from protocol/${name}: run \`npm run build\``,
    );
  }
  assert.equal(path.resolve(SCRIPTS_DIR), path.resolve(copy), 'the package reads its copy');
});

test('scripts: every protocol script by name, with its SHA1', () => {
  assert.deepEqual([...SCRIPT_NAMES].sort(), readdirSync(protocol).filter((n) => n.endsWith('.lua')).map((n) => n.slice(0, -4)).sort());
  for (const name of SCRIPT_NAMES) {
    assert.equal(scripts[name], readFileSync(path.join(protocol, `${name}.lua`), 'utf8'));
    assert.equal(scriptShas[name], createHash('sha1').update(scripts[name]).digest('hex'));
  }
});
