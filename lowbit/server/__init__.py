"""The OpenAI-compatible HTTP server (FastAPI + uvicorn): `lowbit serve MODEL`."""
