// A fake vLLM engine in another language: vLLM's gRPC services (vllm.Inference, vllm.Control,
// grpc.health.v1) on Node's own HTTP/2 server, with protobuf encoded by hand.
//
// It exists so gateway CPU can be compared in front of an engine whose costs and timing are
// not the ones our Python mock has: a single-threaded event loop written in another runtime,
// with its own HTTP/2 stack and flow control. It generates exactly max_new_tokens copies of
// one token (given with its text), paced by one global step like a real engine's batch:
// every running stream gets one token per step, written in that step.
//
//   node bench/node_engine.mjs --port P --dp-size 2 --model NAME --model-id DIR \
//        --token-id ID --token-text TEXT [--step-ms 2] [--kv-events-port K]
//
// --kv-events-port names ranks' ZMQ endpoints (K, K+1, ...) in GetKvEventSources; nothing
// publishes there, so a gateway subscribes and hears no events.

import http2 from "node:http2";
import { parseArgs } from "node:util";

const { values: opts } = parseArgs({
  options: {
    port: { type: "string" },
    "dp-size": { type: "string", default: "2" },
    model: { type: "string", default: "bench-model" },
    "model-id": { type: "string" },
    "token-id": { type: "string" },
    "token-text": { type: "string" },
    "step-ms": { type: "string", default: "0" },
    "kv-events-port": { type: "string", default: "0" },
    "block-size": { type: "string", default: "16" },
    "max-model-len": { type: "string", default: "8192" },
  },
});
const DP = Number(opts["dp-size"]);
const TOKEN = Number(opts["token-id"]);
const TEXT = opts["token-text"];
const STEP_MS = Number(opts["step-ms"]);
const KV_PORT = Number(opts["kv-events-port"]);
const BLOCK = Number(opts["block-size"]);
const MAX_LEN = Number(opts["max-model-len"]);

// ---- protobuf, by hand: only the wire types and fields this engine reads or writes.

function varint(n) {
  const out = [];
  let v = BigInt(n);
  while (v > 0x7fn) {
    out.push(Number(v & 0x7fn) | 0x80);
    v >>= 7n;
  }
  out.push(Number(v));
  return Buffer.from(out);
}
const tag = (field, wire) => varint((field << 3) | wire);
const u64 = (field, n) => (n ? Buffer.concat([tag(field, 0), varint(n)]) : Buffer.alloc(0));
const bytes = (field, buf) => Buffer.concat([tag(field, 2), varint(buf.length), buf]);
const str = (field, s) => (s ? bytes(field, Buffer.from(s, "utf8")) : Buffer.alloc(0));
const msg = (field, parts) => bytes(field, Buffer.concat(parts));
function packed(field, values) {
  if (!values.length) return Buffer.alloc(0);
  return bytes(field, Buffer.concat(values.map(varint)));
}

// field number -> list of raw values (numbers for varints, Buffers for length-delimited).
function decode(buf) {
  const fields = new Map();
  let i = 0;
  const readVarint = () => {
    let result = 0;
    let shift = 0;
    for (;;) {
      const b = buf[i++];
      result += (b & 0x7f) * 2 ** shift;
      if (b < 0x80) return result;
      shift += 7;
    }
  };
  while (i < buf.length) {
    const key = readVarint();
    const field = Math.floor(key / 8);
    const wire = key & 7;
    let value;
    if (wire === 0) value = readVarint();
    else if (wire === 2) {
      const len = readVarint();
      value = buf.subarray(i, i + len);
      i += len;
    } else if (wire === 1) {
      value = buf.subarray(i, i + 8);
      i += 8;
    } else if (wire === 5) {
      value = buf.subarray(i, i + 4);
      i += 4;
    } else throw new Error(`wire type ${wire}`);
    if (!fields.has(field)) fields.set(field, []);
    fields.get(field).push(value);
  }
  return fields;
}
const first = (fields, field, fallback) => (fields.get(field) || [fallback])[0];

function promptTokens(request) {
  const ids = first(request, 4, null);
  if (ids) {
    let count = 0;
    for (const value of decode(ids).get(1) || []) {
      // Packed: count the varints in the buffer; unpacked: one number each.
      if (Buffer.isBuffer(value)) for (const b of value) count += b < 0x80 ? 1 : 0;
      else count += 1;
    }
    return count;
  }
  const text = first(request, 3, Buffer.alloc(0));
  return Math.max(1, Math.ceil(text.length / 4));
}

// ---- the services

const SERVER_INFO = Buffer.concat([
  str(1, "0.32.0"),
  str(2, "vllm"),
  str(3, `node-${process.pid}`),
  msg(4, [u64(1, 1), u64(2, 1), u64(3, DP), u64(5, 1), u64(6, 1), u64(7, DP)]),
  u64(5, MAX_LEN),
  u64(6, BLOCK),
  u64(7, 8192 * DP),
  u64(8, 1024),
  u64(9, 8192),
  msg(11, []),
  u64(14, BLOCK),
]);
const MODEL_INFO = Buffer.concat([
  str(1, opts["model-id"]),
  str(2, opts.model),
  u64(20, 1),
  u64(21, 1),
]);
const KV_SOURCES = Buffer.concat(
  KV_PORT
    ? Array.from({ length: DP }, (_, rank) =>
        msg(1, [
          str(1, "zmq"),
          str(2, `tcp://127.0.0.1:${KV_PORT + rank}`),
          tag(5, 0),
          varint(rank),
          str(6, "msgpack"),
        ]),
      )
    : [],
);

const TOKEN_TEXT = Buffer.from(TEXT, "utf8");

function output(tokens, finished) {
  const parts = [u64(1, 0), bytes(2, Buffer.concat(Array(tokens).fill(TOKEN_TEXT)))];
  parts.push(u64(3, tokens), packed(4, Array(tokens).fill(TOKEN)));
  if (finished !== null) parts.push(msg(8, [u64(1, finished), u64(2, 1)]));
  return msg(2, parts);
}
const promptInfo = (count) => msg(1, [u64(1, count)]);

function frame(payload) {
  const head = Buffer.alloc(5);
  head.writeUInt32BE(payload.length, 1);
  return Buffer.concat([head, payload]);
}

function reply(stream, status, message) {
  if (stream.destroyed) return;
  stream.respond({ ":status": 200, "content-type": "application/grpc" }, { waitForTrailers: true });
  stream.on("wantTrailers", () => stream.sendTrailers({ "grpc-status": String(status), "grpc-message": message || "" }));
  return stream;
}

// Every running stream, stepped together.
const running = new Set();
let timer = null;

function step() {
  for (const run of running) {
    if (run.stream.destroyed || run.stream.closed) {
      running.delete(run);
      continue;
    }
    run.generated += 1;
    const last = run.generated >= run.max;
    const head = run.generated === 1 ? [promptInfo(run.prompt)] : [];
    run.stream.write(frame(Buffer.concat([...head, output(1, last ? run.generated : null)])));
    if (last) {
      running.delete(run);
      run.stream.end();
    }
  }
  if (!running.size) {
    clearInterval(timer);
    timer = null;
  }
}

function generate(stream, request, streaming) {
  const stopping = first(request, 8, null);
  const max = (stopping && first(decode(stopping), 1, 0)) || 16;
  const prompt = promptTokens(request);
  if (!reply(stream, 0)) return;
  if (!streaming) {
    stream.end(frame(Buffer.concat([promptInfo(prompt), output(max, max)])));
    return;
  }
  if (!STEP_MS) {
    for (let n = 1; n <= max; n++) {
      const head = n === 1 ? [promptInfo(prompt)] : [];
      stream.write(frame(Buffer.concat([...head, output(1, n === max ? n : null)])));
    }
    stream.end();
    return;
  }
  running.add({ stream, prompt, max, generated: 0 });
  if (!timer) timer = setInterval(step, STEP_MS);
}

const UNARY = {
  "/vllm.Control/GetServerInfo": SERVER_INFO,
  "/vllm.Control/GetModelInfo": MODEL_INFO,
  "/vllm.Control/GetKvEventSources": KV_SOURCES,
  "/vllm.KvTransfer/GetKvEventSources": KV_SOURCES,
  "/vllm.Control/Abort": Buffer.alloc(0),
  "/grpc.health.v1.Health/Check": u64(1, 1),
};

const server = http2.createServer({ settings: { maxConcurrentStreams: 4096 } });
server.on("stream", (stream, headers) => {
  const path = headers[":path"];
  const chunks = [];
  stream.on("data", (chunk) => chunks.push(chunk));
  stream.on("error", () => {});
  stream.on("end", () => {
    const body = Buffer.concat(chunks).subarray(5);
    if (path in UNARY) {
      if (reply(stream, 0)) stream.end(frame(UNARY[path]));
    } else if (path === "/vllm.Inference/Generate" || path === "/vllm.Inference/GenerateStream") {
      generate(stream, decode(body), path.endsWith("Stream"));
    } else if (reply(stream, 12, `${path} is not implemented`)) {
      stream.end();
    }
  });
});
server.listen(Number(opts.port), "127.0.0.1");
