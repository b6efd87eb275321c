// A doc_search agent in JavaScript, served to rlops over HTTP (tasks/agent.py, `url` mode).
//
//   npm ci && node server.mjs --port 8300 [--host 127.0.0.1]
//
// POST /rollout {prompt_id, prompt, base_url, model, episode_id} runs one episode: the official `openai`
// client, pointed at `base_url` with the header `X-Episode-Id: <episode_id>`, calls the model with two
// tools (`search`, `read`) over examples/doc_search_openai/kb_docs.jsonl until it answers; the reply is
// {messages, metadata: {completion_tokens}}. GET /version is a hash of this file, the lock file and
// the knowledge base, so editing the agent makes new rollouts. It knows nothing about rlops otherwise:
// the same agent runs against any OpenAI-compatible endpoint.

import { createHash } from "node:crypto";
import { readFileSync } from "node:fs";
import { createServer } from "node:http";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import OpenAI from "openai";

const HERE = dirname(fileURLToPath(import.meta.url));
const KB = join(HERE, "..", "doc_search_openai", "kb_docs.jsonl");
const DOCS = readFileSync(KB, "utf8").split("\n").filter((l) => l.trim()).map((l) => JSON.parse(l));
const VERSION = createHash("sha256")
  .update(readFileSync(fileURLToPath(import.meta.url)))
  .update(readFileSync(join(HERE, "package-lock.json")))
  .update(readFileSync(KB))
  .digest("hex")
  .slice(0, 16);

const SYSTEM_PROMPT =
  "You answer questions about a private knowledge base. Its facts are not public, so do not guess: " +
  "search for the entity in the question, read the document that describes it, then reply with " +
  "the short answer only (a name, a number or a year).";
const TOOLS = [
  {
    type: "function",
    function: {
      name: "search",
      description: "Search the knowledge base; returns the best matches as 'doc_id: title — first sentence'.",
      parameters: {
        type: "object",
        properties: { query: { type: "string", description: "a few keywords, e.g. a name" } },
        required: ["query"],
      },
    },
  },
  {
    type: "function",
    function: {
      name: "read",
      description: "Read the full text of one document by its id.",
      parameters: {
        type: "object",
        properties: { doc_id: { type: "string", description: "an id returned by search" } },
        required: ["doc_id"],
      },
    },
  },
];
const MAX_TURNS = 4; // model calls per question: search, read and answer take three

// -- the tools: BM25 search (k1 = 1.5, b = 0.75) and read, as examples/doc_search_openai/agent.py --

const STOPWORDS = new Set(
  ("a an and are as at be by did do does for from has have he her his how in is it its of on or " +
    "she that the their them they this to was were what when where which who whom why with").split(" "),
);
const terms = (text) => (text.toLowerCase().match(/[a-z0-9]+/g) || []).filter((t) => !STOPWORDS.has(t));
const counts = (ts) => ts.reduce((m, t) => m.set(t, (m.get(t) || 0) + 1), new Map());
const TF = DOCS.map((d) => counts(terms(`${d.title} ${d.text}`)));
const LEN = TF.map((tf) => [...tf.values()].reduce((a, b) => a + b, 0));
const DF = new Map();
for (const tf of TF) for (const t of tf.keys()) DF.set(t, (DF.get(t) || 0) + 1);
const IDF = new Map([...DF].map(([t, f]) => [t, Math.log((DOCS.length - f + 0.5) / (f + 0.5) + 1.0)]));
const AVG = LEN.reduce((a, b) => a + b, 0) / LEN.length;
const firstSentence = (text) => text.split(/(?<=[.!?])\s+/)[0];

function search(query, k = 3) {
  const q = terms(String(query));
  const scores = TF.map((tf, i) => {
    const norm = 1.5 * (0.25 + (0.75 * LEN[i]) / AVG);
    let s = 0;
    for (const t of q) if (tf.get(t)) s += (IDF.get(t) * tf.get(t) * 2.5) / (tf.get(t) + norm);
    return [s, i];
  });
  scores.sort((a, b) => b[0] - a[0] || a[1] - b[1]);
  const hits = scores.slice(0, k).filter(([s]) => s > 0).map(([, i]) => i);
  if (!hits.length) return `No documents match '${query}'. Try other keywords, such as a name from the question.`;
  return hits.map((i) => `${DOCS[i].doc_id}: ${DOCS[i].title} — ${firstSentence(DOCS[i].text)}`).join("\n");
}

function read(docId) {
  const doc = DOCS.find((d) => d.doc_id === String(docId).trim());
  if (!doc) return `Error: no document with id '${docId}'. Use an id returned by search, such as '${DOCS[0].doc_id}'.`;
  return `${doc.title}\n${doc.text}`;
}

// A tool call's result; every failure is a message for the model, never an exception.
function runTool(name, args) {
  const tools = { search: (a) => search(a.query), read: (a) => read(a.doc_id) };
  if (!(name in tools)) return `error: unknown tool '${name}'; available: read, search`;
  let parsed;
  try {
    parsed = JSON.parse(args);
  } catch (e) {
    return `error: arguments of '${name}' are not valid JSON (${e.message})`;
  }
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
    return `error: arguments of '${name}' must be a JSON object`;
  }
  return tools[name](parsed);
}

// -- the agent loop --------------------------------------------------------------------------------

async function rollout({ prompt, base_url, model, episode_id }) {
  const client = new OpenAI({
    baseURL: base_url,
    apiKey: "unused",
    maxRetries: 0,
    defaultHeaders: { "X-Episode-Id": episode_id }, // every call is recorded under this episode
  });
  const messages = [
    { role: "system", content: SYSTEM_PROMPT },
    { role: "user", content: prompt },
  ];
  let completionTokens = 0;
  for (let turn = 0; turn < MAX_TURNS; turn++) {
    let response;
    try {
      response = await client.chat.completions.create({ model, messages, tools: TOOLS });
    } catch (e) {
      if (e instanceof OpenAI.BadRequestError) break; // the conversation outgrew the model's context
      throw e;
    }
    completionTokens += response.usage?.completion_tokens ?? 0;
    const message = response.choices[0].message;
    const kept = { role: "assistant" }; // as the model wrote it: rlops finds its recorded tokens by it
    if (message.content != null) kept.content = message.content;
    if (message.tool_calls?.length) kept.tool_calls = message.tool_calls;
    messages.push(kept);
    if (!message.tool_calls?.length || turn === MAX_TURNS - 1) break;
    for (const call of message.tool_calls) {
      messages.push({
        role: "tool",
        tool_call_id: call.id,
        name: call.function.name,
        content: runTool(call.function.name, call.function.arguments),
      });
    }
  }
  return { messages, metadata: { completion_tokens: completionTokens } };
}

// -- the service: Node's own http module -------------------------------------------------------------

function send(res, status, body) {
  const text = typeof body === "string" ? body : JSON.stringify(body);
  res.writeHead(status, { "Content-Type": typeof body === "string" ? "text/plain" : "application/json" });
  res.end(text);
}

function serve(host, port) {
  const server = createServer(async (req, res) => {
    try {
      if (req.method === "GET" && req.url === "/version") return send(res, 200, { version: VERSION });
      if (req.method !== "POST" || req.url !== "/rollout") return send(res, 404, { error: "not found" });
      const chunks = [];
      for await (const chunk of req) chunks.push(chunk);
      const body = JSON.parse(Buffer.concat(chunks).toString("utf8"));
      for (const key of ["prompt", "base_url", "model", "episode_id"]) {
        if (typeof body[key] !== "string") return send(res, 400, { error: `'${key}' must be a string` });
      }
      send(res, 200, await rollout(body));
    } catch (e) {
      send(res, 500, { error: `${e.name}: ${e.message}` }); // rlops records it as the episode's error
    }
  });
  server.requestTimeout = 0; // an episode may take minutes; rlops applies its own timeout
  server.listen(port, host, () => console.log(`doc_search agent on http://${host}:${port}/rollout`));
}

function arg(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i >= 0 ? process.argv[i + 1] : fallback;
}

serve(arg("host", "127.0.0.1"), Number(arg("port", "8300")));
