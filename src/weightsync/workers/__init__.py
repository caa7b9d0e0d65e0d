"""The worker kit: what every engine's workers share (a receiver under a trainer or a server)."""
