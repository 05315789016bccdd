"""Wire formats: the protobuf APIs under mtpserve/v1 (generated code) and the tensor codec; no project imports."""
