"""mitmproxy addons, one concern each; ``addons/interception.py`` is the script mitmdump loads
and lists them in the order a request travels through them."""
