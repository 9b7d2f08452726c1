"""The application's keys (aiohttp AppKeys): the broker process, the router, the HTTP client.

Their own module so that every resource module (broker.api.*) imports them at the top, and
broker.api.app, which registers those modules' routes, imports none of them back.
"""

from __future__ import annotations

import aiohttp
from aiohttp import web

from broker.process import Broker
from broker.state.router import Router

BROKER = web.AppKey("broker", Broker)
ROUTER = web.AppKey("router", Router)
HTTP = web.AppKey("http", aiohttp.ClientSession)  # the broker's one client session (job logs)
