// An open-loop load generator: POST requests at a fixed mean rate, whatever the answers' pace.
//
// `h2load --rps` gives each connection its share of the rate on a timer of its own, and its
// connections start together, so they send in step: bursts of one request per connection.
// A gateway then serves a burst in one wake-up, which is not what many independent clients
// make. Here arrivals are a Poisson process (exponential gaps, the usual model of independent
// clients; `--even` spaces them evenly instead) over at most `--clients` keep-alive
// connections. With `--unique` every request's last message gets a question of its own, so no
// two prompts are the same past their shared head: a gateway's caches of whole prompts stop
// helping, and the engine stores new KV blocks (and publishes their events) for every request.
//
//   node bench/open_loop.mjs --url URL --body FILE --rate R --seconds S [--clients C]
//        [--unique] [--even] [--seed N] [--header "name: value" ...]
//
// Prints one JSON line: requests, ok (2xx with a JSON body), wall seconds, mean and p50 / p99
// latency in ms, and the mean lateness of sends against their schedule (the generator's own
// lag: a figure well above a millisecond means the client, not the gateway, set the pace).

import http from "node:http";
import { readFileSync } from "node:fs";
import { parseArgs } from "node:util";

const { values: opts } = parseArgs({
  options: {
    url: { type: "string" },
    body: { type: "string" },
    rate: { type: "string" },
    seconds: { type: "string" },
    clients: { type: "string", default: "16" },
    unique: { type: "boolean", default: false },
    even: { type: "boolean", default: false },
    seed: { type: "string", default: "1" },
    header: { type: "string", multiple: true, default: [] },
  },
});

const target = new URL(opts.url);
const template = JSON.parse(readFileSync(opts.body, "utf8"));
const rate = Number(opts.rate);
const total = Math.max(1, Math.round(rate * Number(opts.seconds)));
const agent = new http.Agent({ keepAlive: true, maxSockets: Number(opts.clients) });
const headers = { "content-type": "application/json" };
for (const line of opts.header) {
  const at = line.indexOf(":");
  headers[line.slice(0, at).trim().toLowerCase()] = line.slice(at + 1).trim();
}

// mulberry32: a small seeded generator, so a run's arrival times can be repeated.
let state = Number(opts.seed) >>> 0;
function random() {
  state = (state + 0x6d2b79f5) >>> 0;
  let t = state;
  t = Math.imul(t ^ (t >>> 15), t | 1);
  t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
  return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
}

function body(n) {
  if (!opts.unique) return JSON.stringify(template);
  const request = structuredClone(template);
  const question = ` Question ${n}: what does item ${(n * 7919) % 1000003} weigh?`;
  if (Array.isArray(request.messages)) {
    const last = request.messages[request.messages.length - 1];
    last.content += question;
  } else {
    request.prompt += question;
  }
  return JSON.stringify(request);
}

// Send times, in ms from the start, drawn before the run so drawing costs nothing during it.
const schedule = new Float64Array(total);
let at = 0;
for (let n = 0; n < total; n++) {
  schedule[n] = at;
  at += opts.even ? 1000 / rate : (-Math.log(1 - random()) * 1000) / rate;
}

const latencies = new Float64Array(total);
let sent = 0;
let done = 0;
let ok = 0;
let lateness = 0;
const start = performance.now();

function send(n) {
  const payload = body(n);
  const began = performance.now();
  lateness += began - start - schedule[n];
  const request = http.request(
    {
      hostname: target.hostname,
      port: target.port,
      path: target.pathname,
      method: "POST",
      agent,
      headers: { ...headers, "content-length": Buffer.byteLength(payload) },
    },
    (response) => {
      const chunks = [];
      response.on("data", (chunk) => chunks.push(chunk));
      response.on("end", () => {
        latencies[n] = performance.now() - began;
        if (response.statusCode >= 200 && response.statusCode < 300) {
          try {
            JSON.parse(Buffer.concat(chunks).toString("utf8"));
            ok++;
          } catch {}
        }
        finish();
      });
    },
  );
  request.on("error", () => {
    latencies[n] = performance.now() - began;
    finish();
  });
  request.end(payload);
}

function finish() {
  done++;
  if (done < total) return;
  const wall = (performance.now() - start) / 1000;
  const sorted = Array.from(latencies).sort((a, b) => a - b);
  const mean = sorted.reduce((a, b) => a + b, 0) / total;
  console.log(
    JSON.stringify({
      requests: total,
      ok,
      wall,
      mean_ms: mean,
      p50_ms: sorted[Math.floor(total * 0.5)],
      p99_ms: sorted[Math.min(total - 1, Math.floor(total * 0.99))],
      late_ms: lateness / total,
    }),
  );
  agent.destroy();
}

function tick() {
  const now = performance.now() - start;
  while (sent < total && schedule[sent] <= now) send(sent++);
  if (sent < total) setTimeout(tick, Math.max(0, schedule[sent] - (performance.now() - start)));
}

tick();
