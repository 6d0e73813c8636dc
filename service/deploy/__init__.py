"""The production shape on one machine: Nginx in front of Gunicorn instances pinned to disjoint cores."""
