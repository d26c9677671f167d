// An MCP server built with the official TypeScript SDK (@modelcontextprotocol/sdk, pinned by
// package-lock.json beside this file), for the broker to stand in front of: the TypeScript twin of
// tests/upstream_server.py, in the one era this SDK speaks (2025: it has no server/discover and
// no subscriptions/listen).
//
// Notes note://<id> are its resources (listed, read, and the template note://{id}), watched with
// resources/subscribe: notifications/resources/updated goes on the subscribing session's GET
// stream, which an event store of its own lets a client resume with Last-Event-ID. One tool,
// set_note(id, text): it changes a note and tells the note's subscribers (a new note also changes
// the resource list).
//
// Stateful Streamable HTTP, the SDK's way: one transport and one low-level Server per session,
// made at its initialize; the notes and the subscriptions are the process's.
//
// Side doors a test reads, outside MCP: GET /healthz, and GET /stats: each request's method and
// headers, the sessions open, the GET streams open, the sessions subscribed to each note now and
// the resources/subscribe requests each note was ever sent.
//
// Run: node server.mjs --port N (loopback only).

import { randomUUID } from 'node:crypto';
import http from 'node:http';

import { Server } from '@modelcontextprotocol/sdk/server/index.js';
import { StreamableHTTPServerTransport } from '@modelcontextprotocol/sdk/server/streamableHttp.js';
import {
    CallToolRequestSchema,
    ErrorCode,
    isInitializeRequest,
    ListResourcesRequestSchema,
    ListResourceTemplatesRequestSchema,
    ListToolsRequestSchema,
    McpError,
    ReadResourceRequestSchema,
    SubscribeRequestSchema,
    UnsubscribeRequestSchema,
} from '@modelcontextprotocol/sdk/types.js';

const RESOURCE_NOT_FOUND = -32002;
const REQUESTS_KEPT = 2000;

const notes = new Map([['1', 'one'], ['2', 'two'], ['3', 'three']]);
/** Session id -> {transport, server}. */
const sessions = new Map();
/** URI -> the ids of the sessions subscribed to it. */
const watchers = new Map();
/** URI -> the resources/subscribe requests for it ever received. */
const subscribes = new Map();
/** What came to /mcp, newest last: {method, headers}. */
const requests = [];
let getStreams = 0;

/** A session's event store: its streams' events kept in order, so a GET stream resumes after the last one seen. */
class EventStore {
    constructor() {
        this.events = new Map();
        this.next = 1;
    }

    async storeEvent(streamId, message) {
        const eventId = `${this.next++}`;
        this.events.set(eventId, { streamId, message });
        return eventId;
    }

    async getStreamIdForEventId(eventId) {
        return this.events.get(eventId)?.streamId;
    }

    async replayEventsAfter(lastEventId, { send }) {
        const last = this.events.get(lastEventId);
        if (last === undefined) {
            throw new Error(`no event ${lastEventId} to resume after`);
        }
        for (const [eventId, { streamId, message }] of this.events) {
            if (Number(eventId) > Number(lastEventId) && streamId === last.streamId) {
                await send(eventId, message);
            }
        }
        return last.streamId;
    }
}

function textResult(text) {
    return { content: [{ type: 'text', text }] };
}

async function setNote(id, text) {
    const uri = `note://${id}`;
    const isNew = !notes.has(id);
    notes.set(id, text);
    for (const sessionId of watchers.get(uri) ?? []) {
        await tell(sessionId, (server) => server.sendResourceUpdated({ uri }));
    }
    if (isNew) {
        for (const sessionId of sessions.keys()) {
            await tell(sessionId, (server) => server.sendResourceListChanged());
        }
    }
}

/** Notify one session; a session that ended meanwhile is forgotten. */
async function tell(sessionId, send) {
    const session = sessions.get(sessionId);
    if (session === undefined) {
        forget(sessionId);
        return;
    }
    try {
        await send(session.server);
    } catch (error) {
        console.error(`session ${sessionId}: a notification was not sent: ${error}`);
    }
}

function forget(sessionId) {
    sessions.delete(sessionId);
    for (const ids of watchers.values()) {
        ids.delete(sessionId);
    }
}

function newServer(sessionIdOf) {
    const server = new Server(
        { name: 'ts-upstream', version: '1.0.0' },
        {
            capabilities: { resources: { subscribe: true, listChanged: true }, tools: {} },
            instructions: 'Notes, for the broker to stand in front of.',
        },
    );
    server.setRequestHandler(ListResourcesRequestSchema, async () => ({
        resources: [...notes.keys()].map((id) => ({ uri: `note://${id}`, name: `note ${id}`, mimeType: 'text/plain' })),
    }));
    server.setRequestHandler(ListResourceTemplatesRequestSchema, async () => ({
        resourceTemplates: [{ name: 'note', uriTemplate: 'note://{id}', mimeType: 'text/plain' }],
    }));
    server.setRequestHandler(ReadResourceRequestSchema, async (request) => {
        const uri = request.params.uri;
        const id = uri.startsWith('note://') ? uri.slice('note://'.length) : undefined;
        if (id === undefined || !notes.has(id)) {
            throw new McpError(RESOURCE_NOT_FOUND, `Resource not found: ${uri}`, { uri });
        }
        return { contents: [{ uri, mimeType: 'text/plain', text: notes.get(id) }] };
    });
    server.setRequestHandler(SubscribeRequestSchema, async (request) => {
        const uri = request.params.uri;
        subscribes.set(uri, (subscribes.get(uri) ?? 0) + 1);
        if (!watchers.has(uri)) {
            watchers.set(uri, new Set());
        }
        watchers.get(uri).add(sessionIdOf());
        return {};
    });
    server.setRequestHandler(UnsubscribeRequestSchema, async (request) => {
        watchers.get(request.params.uri)?.delete(sessionIdOf());
        return {};
    });
    server.setRequestHandler(ListToolsRequestSchema, async () => ({
        tools: [{
            name: 'set_note',
            description: 'Write a note',
            inputSchema: {
                type: 'object',
                properties: { id: { type: 'string' }, text: { type: 'string' } },
                required: ['id', 'text'],
            },
        }],
    }));
    server.setRequestHandler(CallToolRequestSchema, async (request) => {
        const { name, arguments: args = {} } = request.params;
        if (name !== 'set_note') {
            throw new McpError(ErrorCode.InvalidParams, `Unknown tool: ${name}`);
        }
        if (typeof args.id !== 'string' || typeof args.text !== 'string') {
            throw new McpError(ErrorCode.InvalidParams, 'set_note takes a string id and a string text');
        }
        await setNote(args.id, args.text);
        return textResult(`note://${args.id} set`);
    });
    return server;
}

function json(res, status, body) {
    res.writeHead(status, { 'Content-Type': 'application/json' });
    res.end(JSON.stringify(body));
}

function stats() {
    const subscriptions = {};
    for (const [uri, ids] of watchers) {
        if (ids.size > 0) {
            subscriptions[uri] = ids.size;
        }
    }
    return {
        requests, sessions: sessions.size, get_streams: getStreams, subscriptions,
        subscribes: Object.fromEntries(subscribes), notes: Object.fromEntries(notes), pid: process.pid,
    };
}

async function readBody(req) {
    const chunks = [];
    for await (const chunk of req) {
        chunks.push(chunk);
    }
    return Buffer.concat(chunks).toString('utf8');
}

async function mcp(req, res) {
    requests.push({ method: req.method, headers: req.headers });
    if (requests.length > REQUESTS_KEPT) {
        requests.shift();
    }
    const sessionId = req.headers['mcp-session-id'];
    if (sessionId !== undefined) {
        const session = sessions.get(sessionId);
        if (session === undefined) {
            json(res, 404, { jsonrpc: '2.0', id: null, error: { code: -32001, message: 'Session not found' } });
            return;
        }
        if (req.method === 'GET') {
            getStreams += 1;
            res.on('close', () => { getStreams -= 1; });
        }
        await session.transport.handleRequest(req, res);
        return;
    }
    if (req.method !== 'POST') {
        json(res, 400, { jsonrpc: '2.0', id: null, error: { code: -32000, message: 'Bad Request: no session' } });
        return;
    }
    let body;
    try {
        body = JSON.parse(await readBody(req));
    } catch {
        json(res, 400, { jsonrpc: '2.0', id: null, error: { code: -32700, message: 'Parse error' } });
        return;
    }
    if (!isInitializeRequest(body)) {
        // What a server of the 2025 protocol answers a 2026-07-28 server/discover, or any request outside a session.
        json(res, 400, { jsonrpc: '2.0', id: body?.id ?? null,
                         error: { code: -32000, message: 'Bad Request: no valid session id' } });
        return;
    }
    let transport;
    const server = newServer(() => transport.sessionId);
    transport = new StreamableHTTPServerTransport({
        sessionIdGenerator: () => randomUUID(),
        eventStore: new EventStore(),
        onsessioninitialized: (id) => { sessions.set(id, { transport, server }); },
    });
    transport.onclose = () => {
        if (transport.sessionId !== undefined) {
            forget(transport.sessionId);
        }
    };
    await server.connect(transport);
    await transport.handleRequest(req, res, body);
}

function port() {
    const at = process.argv.indexOf('--port');
    const value = at >= 0 ? Number(process.argv[at + 1]) : NaN;
    if (!Number.isInteger(value) || value <= 0 || value > 65535) {
        console.error('usage: node server.mjs --port N');
        process.exit(2);
    }
    return value;
}

const httpServer = http.createServer((req, res) => {
    const path = new URL(req.url, 'http://localhost').pathname;
    const handle = path === '/mcp' ? mcp(req, res)
        : path === '/stats' && req.method === 'GET' ? Promise.resolve(json(res, 200, stats()))
        : path === '/healthz' ? Promise.resolve(json(res, 200, { ok: true }))
        : Promise.resolve(json(res, 404, { error: 'not found' }));
    handle.catch((error) => {
        console.error(`${req.method} ${path}: ${error?.stack ?? error}`);
        if (!res.headersSent) {
            json(res, 500, { jsonrpc: '2.0', id: null, error: { code: -32603, message: 'Internal error' } });
        } else {
            res.end();
        }
    });
});

for (const signal of ['SIGTERM', 'SIGINT']) {
    process.on(signal, () => {
        httpServer.closeAllConnections();
        httpServer.close(() => process.exit(0));
    });
}

httpServer.listen(port(), '127.0.0.1');
