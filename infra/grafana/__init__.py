"""The Grafana dashboard, generated from code (dashboard.py) into osd.json here and the Helm
chart's copy, so its metric names cannot drift from the registered ones. Imports nothing
from the project."""
