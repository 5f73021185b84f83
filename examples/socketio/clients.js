#!/usr/bin/env node
// The client fleet: many real socket.io-client connections (websocket) in one process.
//
// Each connection is one device of one user: `auth` = {user, device, room}. In layout
// `conns` some users have two devices, placed on two different servers. A connection that
// is lost (its server killed, frozen then fenced, or shut down) reconnects to another live
// server of the list it was last told, except where its fault policy says otherwise: after
// a kill or a freeze about 1 in 10 connections never come back ("gone") and 1 in 10 come
// back only when told (`release`, once the janitor cleaned the server: "late"). Each
// connection records the messages it receives and its moves (lost at, welcomed at, by
// which server id).
//
// Driven by its parent over IPC: `start` {servers, users, layout}, `servers` {list},
// `fault` {serverId, mode}, `release`, `snapshot`, `stop`.
import { io } from 'socket.io-client';
import { policyOf, report, sleep } from './lib/util.js';

let servers = []; // [{name, url}] live, as the parent (the load balancer) says
const faults = new Map(); // server id (an incarnation) -> 'kill' | 'stop' | 'term'
const clients = [];
let stopping = false;
const lateWaiting = new Set();
const received = new Map(); // message id -> devices that received it

class Client {
  constructor({ index, user, device, room }) {
    Object.assign(this, { index, user, device, room });
    this.policy = policyOf(index, device);
    this.socket = null;
    this.serverName = null;
    this.serverId = null; // set by `welcome`: registered
    this.state = 'idle'; // connecting | connected | waiting | gone
    this.moves = []; // {from, fromName, lostAt, reason, to, toName, registeredAt}
    this.received = 0;
    this.connectErrors = 0;
  }

  connect(server) {
    this.state = 'connecting';
    this.serverName = server.name;
    this.serverId = null;
    const socket = io(server.url, {
      transports: ['websocket'],
      reconnection: false, // reconnection is ours: to another server
      forceNew: true,
      timeout: 10_000,
      auth: { user: this.user, device: `d${this.device}`, room: this.room },
    });
    this.socket = socket;
    socket.on('welcome', ({ serverId }) => {
      if (socket !== this.socket) return;
      this.serverId = serverId;
      this.state = 'connected';
      const move = this.moves.at(-1);
      if (move && move.registeredAt == null) {
        move.to = serverId;
        move.toName = server.name;
        move.registeredAt = Date.now();
      }
    });
    socket.on('message', (m) => {
      if (socket !== this.socket) return;
      this.received++;
      received.set(m.id, (received.get(m.id) ?? 0) + 1);
    });
    socket.on('connect_error', () => {
      if (socket !== this.socket) return;
      this.connectErrors++;
      socket.close();
      this.retry(server.name, 200);
    });
    socket.on('disconnect', (reason) => {
      if (socket !== this.socket || stopping) return;
      const lost = { from: this.serverId, fromName: server.name, lostAt: Date.now(), reason };
      this.moves.push(lost);
      this.serverId = null;
      const mode = lost.from ? faults.get(lost.from) : undefined;
      if ((mode === 'kill' || mode === 'stop') && this.policy === 'gone') {
        this.state = 'gone';
        socket.close();
        return;
      }
      if ((mode === 'kill' || mode === 'stop') && this.policy === 'late') {
        this.state = 'waiting';
        socket.close();
        lateWaiting.add(this);
        return;
      }
      socket.close();
      this.retry(server.name, 0);
    });
  }

  /** Reconnects to a live server other than `avoidName` (and, for a user's second device,
   * other than the server of the first where there is a choice), after `delayMs` + jitter. */
  async retry(avoidName, delayMs) {
    this.state = 'connecting';
    await sleep(delayMs + Math.floor(Math.random() * 100));
    if (stopping) return;
    const others = servers.filter((s) => s.name !== avoidName);
    let choice = others.length ? others : servers;
    const sibling = clients.find((c) => c.user === this.user && c !== this);
    if (sibling?.serverName) {
      const apart = choice.filter((s) => s.name !== sibling.serverName);
      if (apart.length) choice = apart;
    }
    if (choice.length === 0) return this.retry(avoidName, 500);
    this.connect(choice[Math.floor(Math.random() * choice.length)]);
  }
}

function snapshot() {
  const counts = {};
  for (const c of clients) counts[c.state] = (counts[c.state] ?? 0) + 1;
  return {
    type: 'snapshot',
    counts,
    clients: clients.map((c) => ({
      user: c.user,
      device: `d${c.device}`,
      room: c.room,
      policy: c.policy,
      state: c.state,
      serverName: c.serverName,
      serverId: c.serverId,
      moves: c.moves,
      received: c.received,
      connectErrors: c.connectErrors,
    })),
  };
}

process.on('message', async (m) => {
  switch (m?.type) {
    case 'start': {
      servers = m.servers;
      // Placement: device 0 of user i on server i mod n, device 1 on the next one.
      for (const u of m.users) {
        for (let d = 0; d < u.devices; d++) clients.push(new Client({ index: u.index, user: u.user, device: d, room: u.room }));
      }
      const started = Date.now();
      for (let i = 0; i < clients.length; i++) {
        const c = clients[i];
        c.connect(servers[(c.index + c.device) % servers.length]);
        if (i % 50 === 49) await sleep(20); // no SYN storm
      }
      report({ type: 'started', connections: clients.length, tookMs: Date.now() - started });
      break;
    }
    case 'servers':
      servers = m.list;
      break;
    case 'fault':
      faults.set(m.serverId, m.mode);
      break;
    case 'release': {
      const waiting = [...lateWaiting];
      lateWaiting.clear();
      for (const c of waiting) c.retry(c.moves.at(-1)?.fromName, 0);
      report({ type: 'released', count: waiting.length });
      break;
    }
    case 'snapshot':
      report(snapshot());
      break;
    case 'delivered':
      report({ type: 'delivered', received: [...received] });
      break;
    case 'stop':
      stopping = true;
      for (const c of clients) c.socket?.close();
      report({ type: 'stopped' });
      setTimeout(() => process.exit(0), 100);
      break;
  }
});
process.on('disconnect', () => process.exit(0));
