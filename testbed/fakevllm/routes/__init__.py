"""The fake backend's HTTP handlers, one class per concern; ``app.create_app`` lists every route."""
