"""Wire formats: protobuf APIs under mtpserve/v1, the tensor codec, and the step message dataclasses."""
