// Copies the protocol's Lua scripts (../../protocol/*.lua, the one source of truth) into
// this package's scripts/ directory, which the built package reads at run time.
import { copyFileSync, mkdirSync, readdirSync, rmSync } from 'node:fs';
import { fileURLToPath } from 'node:url';

const from = fileURLToPath(new URL('../../../protocol/', import.meta.url));
const to = fileURLToPath(new URL('../scripts/', import.meta.url));
const names = readdirSync(from).filter((n) => n.endsWith('.lua'));
if (names.length === 0) throw new Error(`no Lua scripts in ${from}`);
rmSync(to, { recursive: true, force: true });
mkdirSync(to, { recursive: true });
for (const name of names) copyFileSync(from + name, to + name);
console.log(`copied ${names.length} scripts from ${from} to ${to}`);
