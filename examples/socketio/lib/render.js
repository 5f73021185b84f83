// The figures of one run, as printed by `npm run scenario` and the test.
import { BOUNDS } from './checks.js';

function moves(m) {
  return m ? `${m.backP50} / ${m.backP90} / ${m.backMax} ms (${m.count} clients; sockets lost after ${m.lostP50} ms median, ${m.lostMax} ms last)` : 'n/a';
}

function ms(x) {
  return x == null ? 'n/a' : `${x} ms`;
}

export function render(r, cs) {
  const { kill, stop, term } = r.phases;
  const m = r.messages;
  const s = r.settings;
  const v = (mode) => m.perVictim.find((x) => x.mode === mode);
  const lines = [];
  const row = (k, val) => lines.push(`  ${k.padEnd(62)} ${val}`);
  lines.push(`layout ${r.layout}: ${r.connections} socket.io connections, ${r.users} users${r.twoDeviceUsers ? ` (${r.twoDeviceUsers} with two devices)` : ''}; run took ${(r.tookMs / 1000).toFixed(1)} s`);
  lines.push(`  settings: liveness TTL ${s.ttlMs} ms, heartbeat every ${s.heartbeatMs} ms, heartbeat_grace_ms ${s.graceMs}, reconcile_interval_ms ${s.reconcileIntervalMs}, a message every ${s.sendEveryMs} ms`);
  row('all connections registered and routable after start', ms(r.initialRoutableMs));
  lines.push(`SIGKILL ${kill.serverId} (${kill.connections} connections: ${JSON.stringify(kill.policies)})`);
  row('SIGKILL -> server.dead published (reconciler)', ms(kill.publishedMs));
  row('SIGKILL -> verdict (fence written)', ms(kill.verdictMs));
  row('SIGKILL -> cleanup acknowledged (server.cleaned)', `${ms(kill.ackedMs)} (cleanup: ${kill.evictedEntries} deleted, ${kill.keptEntries} kept)`);
  row('entries announced evicted: by the cleanup / by the drift sweep', `${kill.announced.cleanup} / ${kill.announced.sweep}`);
  row('SIGKILL -> reconnecting clients re-registered (p50 / p90 / last)', moves(kill.moves));
  row('SIGKILL -> every reconnecting client routable (Router, observed)', ms(kill.reRoutableMs));
  row('late clients (back after the cleanup) routable after their return', `${ms(kill.lateRoutableAfterReleaseMs)} (${kill.lateReleased} clients)`);
  lines.push(`SIGSTOP ${stop.serverId} (${stop.connections} connections), SIGCONT after ${stop.stoppedForMs} ms`);
  row('SIGSTOP -> server.dead published (reconciler)', ms(stop.publishedMs));
  row('SIGSTOP -> verdict (fence written)', ms(stop.verdictMs));
  row('SIGSTOP -> cleanup acknowledged', `${ms(stop.ackedMs)} (cleanup: ${stop.evictedEntries} deleted, ${stop.keptEntries} kept)`);
  row('entries announced evicted: by the cleanup / by the drift sweep', `${stop.announced.cleanup} / ${stop.announced.sweep}`);
  row('SIGCONT -> the zombie learns FENCED (its first call)', `${ms(stop.fencedLearnedMs)}; refusals noted ${JSON.stringify(stripLast(stop.refused))}`);
  row('SIGCONT -> back under a new id', `${ms(stop.newIdUpMs)} (${stop.newServerId}), ${stop.socketsClosedOnFence} sockets closed`);
  row('SIGCONT -> reconnecting clients re-registered (p50 / p90 / last)', moves(stop.moves));
  row('SIGCONT -> every reconnecting client routable (Router, observed)', ms(stop.reRoutableMs));
  lines.push(`SIGTERM ${term.serverId} (${term.connections} connections)`);
  row('SIGTERM -> sockets closed, unregistered, close() done', `${ms(term.closedMs)}, exit ${term.exit.code}`);
  row('SIGTERM -> its clients re-registered (p50 / p90 / last)', moves(term.moves));
  row('SIGTERM -> every client routable elsewhere (Router, observed)', ms(term.reRoutableMs));
  const moved = term.keysLeft.filter((k) => k.endsWith(':moved'));
  row('left behind: keys / entries / server.dead', `${term.keysLeft.length - moved.length} / ${term.entriesNaming.length} / ${term.deadEvents}`);
  if (moved.length) row('set aside by the janitor (reverse sweep; expires)', `${moved.join(', ')} (${term.movedMembers} members, PTTL ${term.movedTtlMs} ms)`);
  for (const f of r.falsePositives ?? []) {
    lines.push(`false positive (a live server stalled past the TTL and the grace under load): ${f.serverId} learned FENCED ${ms(f.learnedFencedMs)} after its verdict, back as ${f.backAs}`);
  }
  lines.push(`messages: ${m.sent} routed (one every ~${s.sendEveryMs} ms), routed to a dead or fenced server:`);
  lines.push(`  ${''.padEnd(30)} ${'Router before'.padStart(14)} ${'Router after'.padStart(13)} ${'plain before'.padStart(13)} ${'plain after'.padStart(12)}`);
  for (const x of m.perVictim.filter((y) => y.mode !== 'term')) {
    const label = { kill: 'SIGKILL', stop: 'SIGSTOP' }[x.mode] ?? 'false positive';
    lines.push(`  ${`${label} ${x.serverId}`.padEnd(30)} ${String(x.router.before).padStart(14)} ${String(x.router.after).padStart(13)} ${String(x.plain.before).padStart(13)} ${String(x.plain.after).padStart(12)}`);
  }
  lines.push(`  ${'total'.padEnd(30)} ${String(m.router.before).padStart(14)} ${String(m.router.after).padStart(13)} ${String(m.plain.before).padStart(13)} ${String(m.plain.after).padStart(12)}`);
  const t = v('term');
  lines.push(`  routed to the SIGTERMed server after it closed: Router ${t.router.after}, plain ${t.plain.after}`);
  lines.push(`  last Router answer naming a dead server, after its fault: ${['kill', 'stop'].map((x) => ms(v(x).routerLastBeforeVerdictMs)).join(', ')}; last plain read naming it after the verdict: ${['kill', 'stop'].map((x) => ms(v(x).plainLastAfterVerdictMs)).join(', ')}`);
  const d = m.delivery;
  lines.push(`  delivered: ${d.deliveredOfLive} of ${d.routedLive} messages routed to a live server; ${d.deliveredOfDead} of ${d.routedDead} routed to a dead one`);
  const p = r.presence;
  lines.push(`presence: ${p.viewUsers} users online in ${Object.keys(p.roomDiffs).length ? 'MISMATCHED ' : ''}${p.rooms} rooms (truth ${p.onlineUsers}); ${r.goneUsers} users gone; consumer ${JSON.stringify(p.stats)}`);
  // Connections still naming S when server.cleaned for S was read (their join elsewhere
  // not read yet, or an eviction missed): what both streams said about the first three.
  for (const d of (p.droppedOnCleaned ?? []).slice(0, 3)) lines.push(`  dropped on server.cleaned: ${JSON.stringify(d)}`);
  lines.push(`checks (bounds ${JSON.stringify(BOUNDS)}):`);
  for (const c of cs) lines.push(`  ${c.ok ? 'ok  ' : 'FAIL'} ${c.name}${c.ok ? '' : `: ${c.detail}`}`);
  return lines.join('\n');
}

function stripLast(o) {
  const { last_ms: _, ...rest } = o ?? {};
  return rest;
}
