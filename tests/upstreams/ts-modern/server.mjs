// An MCP server built with the official TypeScript SDK's 2026-07-28 line (@modelcontextprotocol/server,
// pinned by package-lock.json beside this file), for the broker to stand in front of: stateless, every
// request answered by a fresh McpServer from one factory (createMcpHandler), watched with
// subscriptions/listen, whose streams the SDK's own listen router feeds from the handler's notify.
// 2025 requests are refused (legacy: 'reject'): a server of the new era only.
//
// Notes note://<id> are its resources (listed through the template note://{id}, and read). One tool,
// set_note(id, text): it changes a note and publishes notifications/resources/updated for it (a new
// note also changes the resource list).
//
// Side doors a test reads, outside MCP: GET /healthz, and GET /stats: each request's method and
// headers, the listens open now and the URIs they asked for, the listens ever opened (and, for each
// note, those that asked for it).
//
// Run: node server.mjs --port N (loopback only).

import http from 'node:http';

import { createMcpHandler, fromJsonSchema, McpServer, ResourceNotFoundError, ResourceTemplate } from '@modelcontextprotocol/server';

const REQUESTS_KEPT = 2000;

const notes = new Map([['1', 'one'], ['2', 'two'], ['3', 'three']]);
/** What came to /mcp, newest last: {method, headers}. */
const requests = [];
/** Open listens: a number of ours -> the URIs it asked for. */
const listens = new Map();
let listensOpened = 0;
/** URI -> the listens ever opened that asked for it. */
const listened = new Map();
let nextListen = 1;

const setNoteInput = fromJsonSchema({
    type: 'object',
    properties: { id: { type: 'string' }, text: { type: 'string' } },
    required: ['id', 'text'],
});

function newServer() {
    const server = new McpServer(
        { name: 'ts-modern-upstream', version: '1.0.0' },
        {
            // subscribe: without it the SDK's listen router honours no resourceSubscriptions of a listen.
            capabilities: { resources: { subscribe: true, listChanged: true }, tools: {} },
            instructions: 'Notes, for the broker to stand in front of.',
        },
    );
    const template = new ResourceTemplate('note://{id}', {
        list: async () => ({
            resources: [...notes.keys()].map((id) => ({ uri: `note://${id}`, name: `note ${id}`, mimeType: 'text/plain' })),
        }),
    });
    server.registerResource('note', template, { mimeType: 'text/plain' }, async (uri, { id }) => {
        if (!notes.has(id)) {
            throw new ResourceNotFoundError(uri.href);
        }
        return { contents: [{ uri: uri.href, mimeType: 'text/plain', text: notes.get(id) }] };
    });
    server.registerTool('set_note', { description: 'Write a note', inputSchema: setNoteInput }, async ({ id, text }) => {
        const isNew = !notes.has(id);
        notes.set(id, text);
        handler.notify.resourceUpdated(`note://${id}`);
        if (isNew) {
            handler.notify.resourcesChanged();
        }
        return { content: [{ type: 'text', text: `note://${id} set` }] };
    });
    return server;
}

const handler = createMcpHandler(newServer, {
    legacy: 'reject',
    onerror: (error) => console.error(`mcp: ${error?.stack ?? error}`),
});

function json(res, status, body) {
    res.writeHead(status, { 'Content-Type': 'application/json' });
    res.end(JSON.stringify(body));
}

async function readBody(req) {
    const chunks = [];
    for await (const chunk of req) {
        chunks.push(chunk);
    }
    return Buffer.concat(chunks);
}

/** node:http in front of the SDK's web-standard handler: the request as a Request, the Response streamed back. */
async function mcp(req, res) {
    requests.push({ method: req.method, headers: req.headers });
    if (requests.length > REQUESTS_KEPT) {
        requests.shift();
    }
    const body = req.method === 'GET' || req.method === 'HEAD' ? undefined : await readBody(req);
    let listen;
    if (body !== undefined) {
        try {
            const message = JSON.parse(body.toString('utf8'));
            if (message?.method === 'subscriptions/listen') {
                listen = nextListen++;
                listensOpened += 1;
                const uris = message.params?.notifications?.resourceSubscriptions ?? [];
                listens.set(listen, uris);
                for (const uri of uris) {
                    listened.set(uri, (listened.get(uri) ?? 0) + 1);
                }
            }
        } catch {
            // not JSON: the SDK answers it
        }
    }
    const headers = new Headers();
    for (const [name, value] of Object.entries(req.headers)) {
        for (const one of Array.isArray(value) ? value : [value]) {
            headers.append(name, one);
        }
    }
    const aborted = new AbortController();
    res.on('close', () => {
        aborted.abort();
        if (listen !== undefined) {
            listens.delete(listen);
        }
    });
    const response = await handler.fetch(new Request(`http://${req.headers.host}${req.url}`, {
        method: req.method, headers, body, signal: aborted.signal,
    }));
    res.writeHead(response.status, Object.fromEntries(response.headers));
    if (response.body === null) {
        res.end();
        return;
    }
    const reader = response.body.getReader();
    res.on('close', () => { reader.cancel().catch(() => {}); });
    for (;;) {
        const { done, value } = await reader.read();
        if (done) {
            break;
        }
        res.write(value);
    }
    res.end();
}

function stats() {
    return {
        requests, listens: listens.size, listening: [...listens.values()].flat().sort(), listens_opened: listensOpened,
        listened: Object.fromEntries(listened), notes: Object.fromEntries(notes), pid: process.pid,
    };
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
        if (error?.name === 'AbortError') {
            res.end();
            return;
        }
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
