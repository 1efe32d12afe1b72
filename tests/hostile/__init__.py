"""The hostile-client suite (issue 8): what an attacker and a bad network do to a real server."""
