"""torchtitan's config module for the peer run (peer_torchtitan.py): `--module tt_peer`."""
