//! Optional local HTTP endpoint: /healthz and /metrics (Prometheus text).
