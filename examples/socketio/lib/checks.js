// What a run of the scenario must show. Invariants are exact (no message routed through
// the Router to a server after its verdict, nothing left of a dead server, the presence
// view equal to the truth); times have generous bounds (a busy 2-core machine), and the
// measured figures are reported beside them.

export const BOUNDS = {
  verdictMs: 30_000, // SIGKILL or SIGSTOP -> the fence (TTL 1.5 s + grace 1.5 s configured)
  reRoutableMs: 20_000, // a fault (SIGCONT for the zombie) -> every client routable again
  lateRoutableMs: 20_000, // the late clients released -> routable
  fencedLearnedMs: 10_000, // SIGCONT -> the zombie learns FENCED (heartbeat every 500 ms)
};

export function checks(r) {
  const out = [];
  const check = (name, ok, detail) => out.push({ name, ok: Boolean(ok), detail });
  const { kill, stop, term } = r.phases;

  check('the sender routed messages throughout', r.messages.sent > 1000, `${r.messages.sent} sent, ${r.messages.senderErrors} errors`);
  for (const v of r.messages.perVictim.filter((x) => x.mode !== 'term')) {
    check(`no message routed through the Router to ${v.serverId} (${v.mode}) after its verdict`, v.router.after === 0, JSON.stringify(v));
  }

  for (const p of [kill, stop]) {
    check(`${p.mode}: verdict on ${p.serverId} within ${BOUNDS.verdictMs} ms`, p.verdictMs != null && p.verdictMs <= BOUNDS.verdictMs, `${p.verdictMs} ms (server.dead from ${p.source} after ${p.publishedMs} ms)`);
    check(`${p.mode}: the dead server's keys are gone once its event is acknowledged`, p.leftovers.keys.length === 0 && !p.leftovers.inServers, JSON.stringify(p.leftovers));
    check(`${p.mode}: no forward entry names the dead server`, p.leftovers.entriesNaming.length === 0, p.leftovers.entriesNaming.slice(0, 5).join(', '));
    check(`${p.mode}: the fence stands`, p.leftovers.fenced, '');
    check(`${p.mode}: its clients routable to their new server within ${BOUNDS.reRoutableMs} ms`, p.reRoutableMs <= BOUNDS.reRoutableMs, `${p.reRoutableMs} ms`);
    check(`${p.mode}: the late clients routable within ${BOUNDS.lateRoutableMs} ms of their return`, p.lateRoutableAfterReleaseMs <= BOUNDS.lateRoutableMs, `${p.lateReleased} clients, ${p.lateRoutableAfterReleaseMs} ms`);
  }
  check('zombie: learned FENCED after SIGCONT', stop.fencedLearnedMs != null && stop.fencedLearnedMs <= BOUNDS.fencedLearnedMs, `${stop.fencedLearnedMs} ms after SIGCONT`);
  const refused = Object.entries(stop.refused ?? {}).filter(([k]) => k !== 'last_ms').reduce((t, [, v]) => t + Number(v), 0);
  check('zombie: its first call was refused (a refusal noted)', refused >= 1, JSON.stringify(stop.refused));
  check('zombie: back under a new server id', stop.newServerId && stop.newServerId !== stop.serverId && stop.newServerId.startsWith(`${stop.name}#`), stop.newServerId);
  check('zombie: it closed the sockets it still held', stop.socketsClosedOnFence > 0, `${stop.socketsClosedOnFence} sockets`);

  check('SIGTERM: the server exited 0', term.exit.code === 0, JSON.stringify(term.exit));
  // `server:{S}:moved` is the janitor's own (the reverse-index sweep's set-aside members):
  // a server that left `servers` is swept no more, so the set goes with its expiry.
  const serverKeys = term.keysLeft.filter((k) => !k.endsWith(':moved'));
  check('SIGTERM: the janitor\'s set-aside members of it expire (no key kept forever)', term.movedMembers === 0 || term.movedTtlMs > 0, `${term.movedMembers} members, PTTL ${term.movedTtlMs} ms`);
  check('SIGTERM: no key of the server is left (users, alive, fence, refusals; `servers`)', serverKeys.length === 0 && !term.inServers, term.keysLeft.join(', '));
  check('SIGTERM: no forward entry names it', term.entriesNaming.length === 0, term.entriesNaming.slice(0, 5).join(', '));
  check('SIGTERM: no server.dead for it', term.deadEvents === 0, `${term.deadEvents}`);
  check(`SIGTERM: its clients routable elsewhere within ${BOUNDS.reRoutableMs} ms`, term.reRoutableMs <= BOUNDS.reRoutableMs, `${term.reRoutableMs} ms`);

  check('the janitor: nothing pending, no dead letter', r.janitor.pending === 0 && r.janitor.deadLetters === 0 && (r.janitor.group?.lag ?? 0) === 0, JSON.stringify({ pending: r.janitor.pending, deadLetters: r.janitor.deadLetters, group: r.janitor.group }));
  for (const p of [kill, stop]) {
    const n = r.janitor.events.filter((e) => e.server_id === p.serverId).length;
    check(`the janitor: one verdict on the ${p.mode === 'kill' ? 'SIGKILLed' : 'SIGSTOPped'} server`, n === 1, `${n} server.dead`);
  }
  for (const f of r.falsePositives) {
    // Not a failure of this example: the janitor did what monitoring's silence said. The
    // server must have handled it as the protocol says.
    check(`false positive on ${f.serverId} (stalled under load): it learned FENCED and came back under a new id`, f.learnedFencedMs != null && f.backAs, JSON.stringify(f));
  }
  check('every client is back but the gone ones', (r.finalCounts.connected ?? 0) + (r.finalCounts.gone ?? 0) === r.connections, JSON.stringify(r.finalCounts));
  check('users whose every connection is gone are unroutable', r.goneUsers > 0 && r.goneRoutable === 0, `${r.goneUsers} gone users, ${r.goneRoutable} routable`);

  const p = r.presence;
  check('presence: online users per room equal the truth', p.roomDiffs.length === 0, JSON.stringify(p.roomDiffs.slice(0, 3)));
  check('presence: every connection on its server, as the truth', p.connMissing.length === 0 && p.connExtra.length === 0, JSON.stringify({ missing: p.connMissing.slice(0, 5), extra: p.connExtra.slice(0, 5) }));
  check('presence: the evictions stream was used', p.stats.evicted > 0, JSON.stringify(p.stats));

  check('shutdown: the servers left `servers` empty', r.remainingAfterShutdown.length === 0, r.remainingAfterShutdown.join(', '));
  check('shutdown: the janitor exited 0', r.janitorExit.worker.code === 0 && r.janitorExit.reconcile.code === 0, JSON.stringify(r.janitorExit));
  return out;
}
