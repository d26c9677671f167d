"""Operations: health and readiness, log formatting, the Prometheus binding."""
