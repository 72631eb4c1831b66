"""The JSON schema the structured-output tests sample against (offline and over HTTP)."""

# nested objects, enums, arrays; strings and arrays bounded so that a sample always ends
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 16},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
