"""The stand-in model server (routing.standin.server), stopped ABRUPTLY: SIGTERM ends the process
at once, dropping whatever it has in flight, as a server without a graceful shutdown does.

The stand-in itself finishes its requests on SIGTERM (aiohttp's graceful shutdown), which
would hide a replica stopped without a drain; with this one, a stream survives a scale-down
only if the agent drained the replica before stopping it (tests/broker/test_services_e2e.py).

Run as a script: python tests/broker/abrupt_modelserver.py <the stand-in's arguments>
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys

from aiohttp import web

from routing.standin import server as modelserver


async def serve_abruptly(settings: modelserver.ModelServerSettings, host: str, port: int) -> None:
    runner = web.AppRunner(modelserver.make_app(settings), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    print(f"listening on http://{host}:{port} (stopped abruptly on SIGTERM)", flush=True)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, lambda: os._exit(143))
    await asyncio.Event().wait()


if __name__ == "__main__":
    modelserver.serve = serve_abruptly  # main() calls serve() when it runs
    sys.exit(modelserver.main(sys.argv[1:]))
