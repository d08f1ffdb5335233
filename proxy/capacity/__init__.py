"""KV pressure: how many tokens the KV pool holds, and where a backend's context length knees."""
