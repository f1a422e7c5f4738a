"""Zero-code HTTP/1.1 requests of watched processes (bpf/http.bpf.c): request spans with no marker."""
