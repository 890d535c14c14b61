"""vLLM's log vocabulary: one named pattern per line it prints, and the watcher that decides a start."""
