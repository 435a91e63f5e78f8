"""What every request goes through before and after its handler (service/app.py orders them).

    access_log.py        one line per request, its X-Request-Id
    metrics.py           Prometheus metrics in vLLM's names, one registry per app
    cross_site.py        CORS, the WebSocket Origin check, the JSON-only body rule
    auth.py              API and admin keys: roles, decided once per request
    security_headers.py  CSP, X-Frame-Options, nosniff, Referrer-Policy
"""
