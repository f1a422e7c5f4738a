// An unmodified Node.js `http` server (core modules only, no tracing) for the zero-code HTTP tests.
// Keep-alive is on (Node's default; idle timeout raised to 30 s). Port: argv[2], else $PORT.
// Endpoints, shared by every server of tests/http/servers/:
//
//   GET  /fast                       200, small fixed body with Content-Length
//   GET  /slow?ms=N                  sleeps N ms (a timer) in the handler, then as /fast
//   POST|PUT /echo                   reads the whole body (Content-Length or chunked); {"len": N}
//   GET  /stream?events=N&gap_ms=M   chunked: N small events, written one by one, M ms apart
//   GET  /pid                        {"pid": process.pid, "tid": 0} (one JS thread; no gettid)
'use strict';
const http = require('http');

const port = Number(process.argv[2] || process.env.PORT);
if (!port) {
  process.stderr.write('usage: node nodeserver.js PORT (or $PORT)\n');
  process.exit(2);
}

function fixed(res, status, ctype, body) {
  const buf = Buffer.from(body);
  res.writeHead(status, { 'Content-Type': ctype, 'Content-Length': buf.length });
  res.end(buf);
}

function intArg(url, name, def) {
  const v = parseInt(url.searchParams.get(name), 10);
  return Number.isNaN(v) ? def : v;
}

const server = http.createServer((req, res) => {
  const url = new URL(req.url, 'http://localhost');
  switch (url.pathname) {
    case '/fast':
      return fixed(res, 200, 'text/plain', 'fast\n');
    case '/slow':
      return setTimeout(() => fixed(res, 200, 'text/plain', 'slow\n'), intArg(url, 'ms', 100));
    case '/echo': {
      if (req.method !== 'POST' && req.method !== 'PUT') {
        return fixed(res, 405, 'text/plain', 'method not allowed\n');
      }
      let n = 0;
      req.on('data', (chunk) => { n += chunk.length; });
      req.on('end', () => fixed(res, 200, 'application/json', JSON.stringify({ len: n })));
      req.on('error', () => fixed(res, 400, 'text/plain', 'bad body\n'));
      return;
    }
    case '/stream': {
      const events = intArg(url, 'events', 3), gap = intArg(url, 'gap_ms', 10);
      res.writeHead(200, { 'Content-Type': 'text/event-stream' });  // no length: chunked
      let i = 0;
      const next = () => {
        res.write(`data: ${i}\n\n`);
        if (++i < events) setTimeout(next, gap); else res.end();
      };
      if (events > 0) next(); else res.end();
      return;
    }
    case '/pid':
      return fixed(res, 200, 'application/json', JSON.stringify({ pid: process.pid, tid: 0 }));
    default:
      return fixed(res, 404, 'text/plain', 'not found\n');
  }
});
server.keepAliveTimeout = 30000;
server.listen(port, '127.0.0.1');
process.on('SIGTERM', () => process.exit(0));
