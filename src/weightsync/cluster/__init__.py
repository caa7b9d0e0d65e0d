"""weightsync across machines: rollout servers placed by a cluster scheduler.

ray_fleet.py: `RolloutFleet`, rollout servers as Ray actors and one push to all of them
(`pip install -e '.[ray]'` from a weightsync checkout; Ray is imported only when a fleet is built).
"""
