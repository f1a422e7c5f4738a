// An unmodified Go net/http server (standard library only, no tracing) for the zero-code HTTP tests.
// Keep-alive is on (net/http's default). Port: argv[1], else $PORT. Endpoints, shared by every server
// of tests/http/servers/:
//
//	GET  /fast                       200, small fixed body with Content-Length
//	GET  /slow?ms=N                  sleeps N ms in the handler, then as /fast
//	POST|PUT /echo                   reads the whole body (Content-Length or chunked); {"len": N}
//	GET  /stream?events=N&gap_ms=M   chunked: N small events, flushed one by one, M ms apart
//	GET  /pid                        {"pid": os pid, "tid": 0} (goroutines have no fixed thread)
package main

import (
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"time"
)

func intArg(r *http.Request, name string, def int) int {
	if v, err := strconv.Atoi(r.URL.Query().Get(name)); err == nil {
		return v
	}
	return def
}

func fixed(w http.ResponseWriter, status int, ctype string, body []byte) {
	w.Header().Set("Content-Type", ctype)
	w.Header().Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(status)
	w.Write(body)
}

func main() {
	port := os.Getenv("PORT")
	if len(os.Args) > 1 {
		port = os.Args[1]
	}
	if port == "" {
		fmt.Fprintln(os.Stderr, "usage: goserver PORT (or $PORT)")
		os.Exit(2)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/fast", func(w http.ResponseWriter, r *http.Request) {
		fixed(w, 200, "text/plain", []byte("fast\n"))
	})
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		time.Sleep(time.Duration(intArg(r, "ms", 100)) * time.Millisecond)
		fixed(w, 200, "text/plain", []byte("slow\n"))
	})
	mux.HandleFunc("/echo", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != "POST" && r.Method != "PUT" {
			fixed(w, 405, "text/plain", []byte("method not allowed\n"))
			return
		}
		n, err := io.Copy(io.Discard, r.Body)
		if err != nil {
			fixed(w, 400, "text/plain", []byte("bad body\n"))
			return
		}
		fixed(w, 200, "application/json", []byte(fmt.Sprintf(`{"len": %d}`, n)))
	})
	mux.HandleFunc("/stream", func(w http.ResponseWriter, r *http.Request) {
		events, gap := intArg(r, "events", 3), intArg(r, "gap_ms", 10)
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(200) // no Content-Length: net/http answers HTTP/1.1 chunked
		f, _ := w.(http.Flusher)
		for i := 0; i < events; i++ {
			if i > 0 {
				time.Sleep(time.Duration(gap) * time.Millisecond)
			}
			fmt.Fprintf(w, "data: %d\n\n", i)
			if f != nil {
				f.Flush()
			}
		}
	})
	mux.HandleFunc("/pid", func(w http.ResponseWriter, r *http.Request) {
		fixed(w, 200, "application/json", []byte(fmt.Sprintf(`{"pid": %d, "tid": 0}`, os.Getpid())))
	})
	srv := &http.Server{Addr: "127.0.0.1:" + port, Handler: mux, IdleTimeout: 30 * time.Second}
	if err := srv.ListenAndServe(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
