"""What is kept between runs: the content-addressed cache, wheels/manifest.json, the index, the remote stores."""
